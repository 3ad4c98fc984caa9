"""Pick the load strategy (weight source) a rank pulls versions from.

Every source is ``(version, verify_checksum) -> LoadedShard`` and runs on the rank's
paddle thread. The model dir's own version (its ``version.txt``) always loads from the
model dir (:class:`~services.worker.weights.SnapshotSource`): that is the initial load.

``object_store`` (FastDeploy's ``rsync``): the rank reads ``<model>/<version>/manifest.json``
and then only its own ``rank<r>-of-<tp>.safetensors`` from the bucket with
:func:`shared.objstore.read_object`. The reader runs on a dedicated thread with its own
asyncio loop and NATS connection (opened at the first pull, kept): the bulk transfer
then never queues behind, or delays, the rank's control and step traffic, and the
paddle thread simply blocks on the result. Tensors are parsed
(:mod:`shared.safetensors`) as zero-copy numpy views of the downloaded buffer, so the
peak extra memory of a pull is **one shard** (the buffer) on top of the staged paddle
copy; the buffer is freed once staged. A shard stored in another float dtype than the
compute dtype (a bf16 / fp16 checkpoint on CPU) is converted tensor by tensor
(:func:`services.worker.hf_files.load_buffer`).

``ipc``: a trainer on the same host wrote ``<ipc_dir>/<model>/<version>/`` (manifest and
shards, see :mod:`services.trainer.publisher`); the rank reads its shard file (shared
memory under ``/dev/shm``) once into private memory, hashes that and parses it as
views of it: no copy through the bus, one copy in all (paddle takes the views without
another). Never a mapping of the file: the trainer may rewrite or remove it meanwhile.
Only what the service can trust is read: see :class:`IpcSource`.

Integrity by default: ``verify_checksum`` None (not given) means verify, since both
strategies always have a manifest. The manifest is validated first
(:func:`shared.manifest.validate`: plain names, this rank's tensors, a size that fits
them), so no buffer is ever sized by an unchecked number.

Errors: unknown version → 404 naming it; size or SHA-256 mismatch, unreadable
safetensors (the header parser names the tensor), wrong names/shapes/dtypes → 422
naming the rank and file; a transfer
that fails (lost chunk, stall, NATS restarted) → 503. A failed pull never stages.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import stat
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np

from services.worker import hf_files
from services.worker.weights import (
    Expected,
    LoadedShard,
    SnapshotSource,
    Source,
    read_shard,
    stat_pin,
)
from shared import manifest as mf
from shared import objstore
from shared import safetensors as st
from shared.bus import Bus
from shared.errors import FORBIDDEN, NOT_FOUND, UNAVAILABLE, UNPROCESSABLE, ControlError
from shared.model_config import ModelConfig
from shared.settings import Settings
from shared.subjects import ckpt_object_name
from shared.versions import check_version_name, ipc_component, model_dir_version

T = TypeVar("T")


def parse_safetensors(buf: Any, where: str) -> dict[str, np.ndarray]:
    """Tensors of a safetensors buffer as raw zero-copy views (bf16 as 2-byte data);
    a malformed buffer is a 422 naming the file and tensor (see :mod:`shared.safetensors`)."""
    try:
        return st.load(buf, where)
    except st.SafetensorsError as e:
        raise ControlError(UNPROCESSABLE, str(e)) from None


class _LoopThread:
    """An asyncio loop on its own daemon thread, for blocking callers to submit to."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise ControlError(
                UNAVAILABLE, f"object-store pull timed out after {timeout:g}s"
            ) from None


class ObjectStoreSource:
    """Pull this rank's shard of a version from the object store (see module doc)."""

    def __init__(self, settings: Settings, fallback: SnapshotSource, rank: int, tp: int) -> None:
        self.settings, self.fallback, self.rank, self.tp = settings, fallback, rank, tp
        self.model = settings.served_model_name
        self.dtype = getattr(fallback, "dtype", "float32")  # the compute dtype
        self.bucket = settings.ckpt_bucket
        self._io: _LoopThread | None = None
        self._bus: Bus | None = None

    def __call__(
        self, version: str, verify_checksum: bool | None, expected: Expected = None
    ) -> LoadedShard:
        if version == model_dir_version(self.settings.model_dir):
            return self.fallback(version, verify_checksum, expected)
        check_version_name(version)
        if self._io is None:
            self._io = _LoopThread(f"objstore-rank{self.rank}")
        verify = True if verify_checksum is None else verify_checksum  # a manifest exists
        # bound the whole pull a little under the engine's scatter timeout
        return self._io.run(self._pull(version, verify, expected), self.settings.control_timeout_s)

    async def _connect(self) -> Bus:
        if self._bus is None or self._bus.nc.is_closed:
            self._bus = await Bus.connect(self.settings.nats_url, f"rollbus-pull-{self.rank}")
        return self._bus

    async def _pull(self, version: str, verify: bool, expected: Expected) -> LoadedShard:
        t0 = time.perf_counter()
        nc = (await self._connect()).nc
        prefix = f"{self.model}/{version}"
        try:
            raw = await objstore.read_object(
                nc,
                self.bucket,
                ckpt_object_name(self.model, version, "manifest.json"),
                max_size=mf.MAX_MANIFEST_BYTES,
            )
        except objstore.ObjectMissing:
            raise ControlError(
                NOT_FOUND,
                f"unknown version {version!r}: no {prefix}/manifest.json in bucket {self.bucket}",
            ) from None
        except objstore.ObjectCorrupt as e:
            raise ControlError(UNPROCESSABLE, f"rank {self.rank}: {e}") from None
        except objstore.ObjectReadDenied as e:  # as a refused meta read (PublishDenied)
            raise ControlError(FORBIDDEN, f"rank {self.rank}: {e}") from None
        except objstore.ObjectReadError as e:
            raise ControlError(UNAVAILABLE, f"rank {self.rank}: {e}") from None
        man = mf.decode(bytes(raw), f"{prefix}/manifest.json")
        # names, tensors and size checked before the shard's buffer is allocated
        spec = mf.validate(man, self.rank, self.tp, expected, prefix)
        name = ckpt_object_name(self.model, version, spec.file)
        where = f"rank {self.rank}: {name}"
        t1 = time.perf_counter()
        try:
            # what these bytes are known by (LoadedShard.pin): the manifest's SHA-256 they
            # are checked against, else the object's meta (every put writes new chunks
            # under a new nuid), looked at before the read: an object replaced meanwhile
            # then differs at the next reload, never hides
            if verify:
                pin = f"sha256:{spec.sha256}"
            else:
                meta = await objstore.get_meta(nc, self.bucket, name)
                pin = f"object:{meta.nuid}:{meta.digest}"
            buf = await objstore.read_object(
                nc,
                self.bucket,
                name,
                expect_size=spec.size,
                expect_sha256=spec.sha256 if verify else None,
            )
        except objstore.ObjectMissing:
            raise ControlError(UNPROCESSABLE, f"{where}: shard object is missing") from None
        except objstore.ObjectCorrupt as e:
            raise ControlError(UNPROCESSABLE, f"{where}: {_after(e, name)}") from None
        except objstore.ObjectReadDenied as e:  # refused, not lost: no retry heals it
            raise ControlError(FORBIDDEN, f"{where}: pull refused: {_after(e, name)}") from None
        except objstore.ObjectReadError as e:
            raise ControlError(UNAVAILABLE, f"{where}: pull failed: {_after(e, name)}") from None
        pull_s = time.perf_counter() - t1
        arrays = hf_files.load_buffer(buf, where, self.dtype, spec.tensors)
        return LoadedShard(
            version,
            arrays,
            [name],
            spec.size,
            {
                "pull_s": pull_s,
                "pull_mib_s": spec.size / (1 << 20) / max(pull_s, 1e-9),
                "verified": verify,
                "load_s": time.perf_counter() - t0,
            },
            {name: pin},
        )


def _after(e: Exception, name: str) -> str:
    return str(e).removeprefix(f"{name}: ")


def _ipc_error(where: str, e: OSError, what: str) -> ControlError:
    if e.errno == errno.ENOENT:
        return ControlError(NOT_FOUND, f"{where}: no such {what}")
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return ControlError(UNPROCESSABLE, f"{where}: is a symlink or not a {what}: refused")
    return ControlError(UNPROCESSABLE, f"{where}: cannot open: {e.strerror}")


def check_owner(st: os.stat_result, uids: frozenset[int], where: str, is_dir: bool) -> None:
    """The ipc trust rule for one entry: a real directory / regular file, owned by the
    service's uid (or the configured trainer uid), not writable by others (files: nor by
    the group)."""
    if is_dir and not stat.S_ISDIR(st.st_mode):
        raise ControlError(UNPROCESSABLE, f"{where}: not a directory: refused")
    if not is_dir and not stat.S_ISREG(st.st_mode):
        raise ControlError(UNPROCESSABLE, f"{where}: not a regular file: refused")
    if not is_dir and st.st_nlink != 1:
        # a hard link: the same bytes are writable through a path outside the version dir
        # (the trainer writes each file fresh: one link)
        raise ControlError(
            UNPROCESSABLE, f"{where}: has {st.st_nlink} hard links (one expected): refused"
        )
    if st.st_uid not in uids:
        raise ControlError(
            UNPROCESSABLE,
            f"{where}: owned by uid {st.st_uid}, not by this service or the trainer "
            f"(uids {sorted(uids)}): refused",
        )
    bad = stat.S_IWOTH if is_dir else stat.S_IWOTH | stat.S_IWGRP
    if st.st_mode & bad:
        raise ControlError(
            UNPROCESSABLE,
            f"{where}: mode {stat.S_IMODE(st.st_mode):04o} is writable by others: refused",
        )


def open_confined(
    name: str, dir_fd: int | None, uids: frozenset[int], where: str, is_dir: bool
) -> int:
    """Open ``name`` (one path component, or the absolute ipc root when ``dir_fd`` is
    None) without following a symlink, and check it with :func:`check_owner`."""
    if dir_fd is not None and (not name or "/" in name or name in (".", "..")):
        raise ControlError(UNPROCESSABLE, f"{where}: not a plain name inside the version")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_DIRECTORY if is_dir else os.O_NONBLOCK  # never block on a FIFO
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        raise _ipc_error(where, e, "directory" if is_dir else "file") from None
    try:
        check_owner(os.fstat(fd), uids, where, is_dir)
    except BaseException:
        os.close(fd)
        raise
    return fd


class IpcSource:
    """Read this rank's shard from shared memory written by a same-host trainer.

    Trust rules (else 422 naming the file): every directory from the ipc root down to
    the version dir and every file read is opened without following symlinks
    (``O_NOFOLLOW``, one component at a time relative to its parent), is a real
    directory / regular file with one link (no hard link), is owned by this service's uid or
    ``ROLLBUS_IPC_TRAINER_UID``, and is not writable by others; the manifest names
    plain files inside the version dir only, with sizes that fit the served tensors.
    """

    def __init__(self, settings: Settings, fallback: SnapshotSource, rank: int, tp: int) -> None:
        self.settings, self.fallback, self.rank, self.tp = settings, fallback, rank, tp
        self.model = settings.served_model_name
        self.dtype = getattr(fallback, "dtype", "float32")  # the compute dtype
        uids = {os.geteuid()}
        if settings.ipc_trainer_uid >= 0:
            uids.add(settings.ipc_trainer_uid)
        self.uids = frozenset(uids)

    def __call__(
        self, version: str, verify_checksum: bool | None, expected: Expected = None
    ) -> LoadedShard:
        if version == model_dir_version(self.settings.model_dir):
            return self.fallback(version, verify_checksum, expected)
        check_version_name(version)
        t0 = time.perf_counter()
        verify = True if verify_checksum is None else verify_checksum  # a manifest exists
        qmodel, qversion = ipc_component(self.model), ipc_component(version)
        prefix = f"{qmodel}/{qversion}"
        fds: list[int] = []
        try:
            unknown = f"unknown version {version!r}: no ipc"
            root = self._open(
                str(self.settings.ipc_dir),
                None,
                f"rank {self.rank}: ipc dir (ROLLBUS_IPC_DIR)",
                True,
                ControlError(NOT_FOUND, f"{unknown} dir"),
            )
            fds.append(root)
            fds.append(
                open_confined(qmodel, root, self.uids, f"rank {self.rank}: ipc {qmodel}", True)
            )
            vdir = self._open(
                qversion,
                fds[-1],
                f"rank {self.rank}: ipc {prefix}",
                True,
                ControlError(NOT_FOUND, f"{unknown} {prefix}"),
            )
            fds.append(vdir)
            return self._load(version, verify, expected, vdir, prefix, t0)
        except OSError as e:  # its reason, never an absolute path
            raise ControlError(
                UNPROCESSABLE, f"rank {self.rank}: ipc {prefix}: {e.strerror or e}"
            ) from None
        finally:
            for fd in fds:
                os.close(fd)

    def _open(
        self, name: str, dir_fd: int | None, where: str, is_dir: bool, missing: ControlError
    ) -> int:
        """:func:`open_confined`, with ``missing`` raised when ``name`` does not exist."""
        try:
            return open_confined(name, dir_fd, self.uids, where, is_dir)
        except ControlError as e:
            if e.code == NOT_FOUND:
                raise missing from None
            raise

    def _load(
        self, version: str, verify: bool, expected: Expected, vdir: int, prefix: str, t0: float
    ) -> LoadedShard:
        mwhere = f"rank {self.rank}: ipc {prefix}/manifest.json"
        fd = self._open(
            "manifest.json",
            vdir,
            mwhere,
            False,
            ControlError(NOT_FOUND, f"unknown version {version!r}: {mwhere}: no such file"),
        )
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > mf.MAX_MANIFEST_BYTES:
                raise ControlError(UNPROCESSABLE, f"{mwhere}: {size} bytes: refused")
            raw = f.read(mf.MAX_MANIFEST_BYTES)
        man = mf.decode(raw, f"ipc {prefix}/manifest.json")
        spec = mf.validate(man, self.rank, self.tp, expected, f"ipc {prefix}")
        name = f"{prefix}/{spec.file}"
        where = f"rank {self.rank}: ipc {name}"
        # the manifest names it: missing is a broken version, not an unknown one
        missing = ControlError(UNPROCESSABLE, f"{where}: shard file is missing")
        fd = self._open(spec.file, vdir, where, False, missing)

        def check_size(size: int) -> None:
            if size != spec.size:
                raise ControlError(UNPROCESSABLE, f"{where}: size {size} != manifest {spec.size}")

        try:
            # read once into private memory, never mapped: the file is the trainer's to
            # rewrite or clean up, and a mapping of it cut short meanwhile was SIGBUS (the
            # rank died) at the next touch, and changed after the hash was served unhashed.
            # What is hashed below is what is parsed and handed to paddle (writable,
            # C-contiguous views: taken over without another copy). No hash binds it
            # when unverified: the file's stat must (read_shard).
            buf, fst = read_shard(fd, where, not verify, check_size)
        finally:
            os.close(fd)
        size = fst.st_size
        timings: dict[str, Any] = {"verified": verify}
        if verify:
            t1 = time.perf_counter()
            if hashlib.sha256(buf).hexdigest() != spec.sha256:
                raise ControlError(UNPROCESSABLE, f"{where}: SHA-256 mismatch with manifest")
            timings["verify_s"] = time.perf_counter() - t1
        arrays = hf_files.load_buffer(buf, where, self.dtype, spec.tensors)
        timings["load_s"] = time.perf_counter() - t0
        pin = f"sha256:{spec.sha256}" if verify else stat_pin(fst)
        return LoadedShard(version, arrays, [f"ipc {name}"], size, timings, {f"ipc {name}": pin})


class FallbackSource:
    """Try ``first``; when it does not know the version (404), try ``second``.

    So every strategy can load every version this host can reach: a version published
    to the object store loads under ``snapshot`` too, and a local ``versions/V`` dir under
    ``object_store``; the strategy only sets which place is looked at first.
    """

    def __init__(self, first: Source, second: Source) -> None:
        self.first, self.second = first, second

    def __call__(
        self, version: str, verify_checksum: bool | None, expected: Expected = None
    ) -> LoadedShard:
        try:
            return self.first(version, verify_checksum, expected)
        except ControlError as e:
            if e.code != NOT_FOUND:
                raise
            first_error = e.message
        try:
            return self.second(version, verify_checksum, expected)
        except ControlError as e:
            if e.code == NOT_FOUND:
                raise ControlError(NOT_FOUND, f"{first_error}; {e.message}") from None
            raise


def served_dtype(settings: Settings) -> str:
    """The rank's compute dtype (weights and KV cache) for every version: from
    ``ROLLBUS_DTYPE``, the device and the model dir's checkpoint dtype."""
    stored = st.checkpoint_dtype(sorted(settings.model_dir.glob("*.safetensors")))
    device = str(getattr(settings, "device", "cpu"))  # ROLLBUS_DEVICE, where it exists
    return hf_files.compute_dtype(settings.dtype, device, stored)


def make_source(settings: Settings, cfg: ModelConfig, rank: int) -> Source:
    dtype = served_dtype(settings)  # for every version
    snap = SnapshotSource(cfg, settings.model_dir, rank, settings.tp, dtype)
    store = ObjectStoreSource(settings, snap, rank, settings.tp)  # connects on first use
    if settings.load_strategy == "object_store":
        return FallbackSource(store, snap)
    if settings.load_strategy == "ipc":
        return FallbackSource(
            IpcSource(settings, snap, rank, settings.tp), FallbackSource(snap, store)
        )
    return FallbackSource(snap, store)
