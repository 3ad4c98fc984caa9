"""Trainer SDK: publish a checkpoint version to every rollout instance.

::

    from services.trainer import CheckpointPublisher

    pub = CheckpointPublisher("nats://127.0.0.1:4222")
    pub.publish("tiny", "step-100", model.state_dict(), tp=2, config="ckpt/config.json")

``source`` is an HF-format model dir (``config.json`` + ``*.safetensors``) or a state
dict of paddle/numpy tensors with training names (see :mod:`services.trainer.names`;
HF names are accepted too), which then needs ``config`` (HF config dict, path, or
``ModelConfig``). The source must not change until the publish returns: a tensor that is
C-contiguous in its shard is sent from its own memory (no copy), so a change while it is
sent shows as a SHA-256 mismatch to a rank that verifies. The publisher maps names,
splits per rank for ``tp``, and uploads ``<model>/<version>/rank<r>-of-<tp>.safetensors``
then ``manifest.json`` (SHA-256 per shard) to bucket ``rollbus_ckpt``, then publishes
:class:`VersionPublished` on ``rollbus.ckpt.<model>.published`` (``Nats-Msg-Id =
<model>/<version>``).

Guarantees: the manifest is written only after every shard, and the event only after
the manifest, so a half-uploaded version is never announced (and a rank asking for it
gets 404). Re-publishing the same content is idempotent (nothing re-uploaded, no
second event); publishing different content under an existing version is refused
(:class:`VersionConflict`): versions are immutable, also between two publishers of one
version at once (the first claims the version, see :class:`_Claim`; the other waits for
its manifest and compares).

``ipc=True`` writes the shards to shared memory instead (``<ipc_dir>/<model>/<version>/``,
default ``/dev/shm/rollbus``; for ranks on this host with ``ROLLBUS_LOAD_STRATEGY=ipc``),
then publishes the same event. Shared memory is RAM: :meth:`remove_ipc` frees it.
Directories are created 0700 and files 0600, through a temporary dir renamed into
place; an existing ipc dir that is a symlink, not ours, or world-writable is refused
(:class:`UnsafeIpcDir`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import logging
import mmap
import os
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.trainer import names
from services.trainer.shards import NonFiniteWeight, ShardLayout, plan_shards, serialize
from shared import manifest as mf
from shared import objstore
from shared import safetensors as st
from shared.bus import Bus
from shared.creds import default_dir, role_url
from shared.errors import ControlError, PublishDenied
from shared.messages import ControlReply, VersionPublished, json_decode
from shared.model_config import ModelConfig
from shared.subjects import Subjects, ckpt_object_name, rank_shard_file
from shared.versions import check_model_name, check_version_name, ipc_version_dir

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
log = logging.getLogger("rollbus.publisher")
DEFAULT_IPC_DIR = Path("/dev/shm/rollbus")


class NotAModelDir(ValueError):
    """The directory is not an HF-format model dir."""


class VersionConflict(ValueError):
    """The version exists with different content."""


class ClaimLost(VersionConflict):
    """This publisher's claim was taken over (it stalled): the taker publishes."""


class NotAnnounced(objstore.ObjectReadError):
    """The version is stored, but its event could not be published (publish again)."""


def _denied_in(e: BaseException) -> PublishDenied | None:
    """The permissions violation behind ``e`` (itself, or what it was raised from)."""
    seen: BaseException | None = e
    for _ in range(8):  # a chain, never a cycle walked forever
        if seen is None:
            return None
        if isinstance(seen, PublishDenied):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass
class PublishResult:
    model: str
    version: str
    tp: int
    bytes: int
    seq: int  # stream sequence of the version event (its place in publish order)
    uploaded: bool  # False when the identical version was already there
    seconds: float
    ipc: bool = False

    @property
    def mib_s(self) -> float:
        return self.bytes / (1 << 20) / max(self.seconds, 1e-9)


@dataclass
class VersionInfo:
    seq: int
    model: str
    version: str
    tp: int
    total_bytes: int
    time: float
    publisher: str


load_config = names.load_config  # one rule for the SDK and the name mappings


def read_model_dir(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and full state dict of an HF model dir; :class:`NotAModelDir` if it is not."""
    if not path.is_dir():
        raise FileNotFoundError(f"no such directory: {path}")
    try:
        files = st.checkpoint_files(path)
    except ValueError as e:
        raise NotAModelDir(f"{path}: {e}") from None
    if not (path / "config.json").is_file() or not files:
        raise NotAModelDir(f"{path} is not an HF model dir (needs config.json and *.safetensors)")
    try:
        cfg = load_config(path / "config.json")
    except ValueError as e:
        raise NotAModelDir(f"{path}/config.json: {e}") from None
    state: dict[str, np.ndarray] = {}
    for f in files:
        state.update(_map_safetensors(f))
    return cfg, state


def _map_safetensors(f: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as read-only views of the mapped file (no read
    into memory: the publisher copies each byte once, from the page cache into the
    shard). The header is parsed by :mod:`shared.safetensors` (strict; ``ValueError``
    naming the file and tensor); bf16 tensors are raw 2-byte views and published as
    bf16, byte for byte."""
    with open(f, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise st.SafetensorsError(f"{f}: not a valid safetensors file: empty")
        # MAP_POPULATE: the page-cache pages mapped in one pass (measured faster than
        # a fault per 4 KiB in the shard-writing threads)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fh.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    return st.load(mm, str(f))


class CheckpointPublisher:
    def __init__(
        self,
        nats_url: str,
        *,
        bucket: str = "rollbus_ckpt",
        ipc_dir: Path | str = DEFAULT_IPC_DIR,
        connect_timeout: float = 5.0,
        instance: str = "default",
    ) -> None:
        # beside the stack, the trainer's credentials are found under DATA_DIR/creds
        self.nats_url = role_url(nats_url, "trainer", default_dir())
        self.instance = instance  # asked for the served config when a state dict has none
        self.bucket = bucket
        self.ipc_dir = Path(ipc_dir)
        self.connect_timeout = connect_timeout
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._rings = _RingCache()  # kept between publishes: no new mappings each version

    # ------------------------------------------------------------------ sync API

    def publish(
        self,
        model: str,
        version: str,
        source: Path | str | Mapping[str, Any],
        *,
        tp: int,
        config: Any = None,
        ipc: bool = False,
        progress: Progress | None = None,
        allow_nonfinite: bool = False,
    ) -> PublishResult:
        return asyncio.run(
            self.apublish(
                model,
                version,
                source,
                tp=tp,
                config=config,
                ipc=ipc,
                progress=progress,
                allow_nonfinite=allow_nonfinite,
            )
        )

    def versions(self, model: str) -> list[VersionInfo]:
        return asyncio.run(self.aversions(model))

    def remove_ipc(self, model: str, version: str) -> None:
        check_model_name(model)  # `..` would name a dir outside ipc_dir
        check_version_name(version)
        shutil.rmtree(ipc_version_dir(self.ipc_dir, model, version), ignore_errors=True)

    # ------------------------------------------------------------------ async API

    def prepare(
        self,
        model: str,
        version: str,
        source: Path | str | Mapping[str, Any],
        tp: int,
        config: Any = None,
        allow_nonfinite: bool = False,
    ) -> tuple[list[bytes], mf.Manifest]:
        """Map names, shard and serialize: (safetensors bytes per rank, manifest)."""
        check_model_name(model)
        cfg, state = self._load(version, source, config)
        return serialize(cfg, state, tp, model, version, check_finite=not allow_nonfinite)

    def _load(
        self, version: str, source: Path | str | Mapping[str, Any], config: Any
    ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
        """Config and HF-named state; transposed weights stay views (copied once later)."""
        check_version_name(version)
        if isinstance(source, str | Path):
            cfg, state = read_model_dir(Path(source))
            if config is not None:
                cfg = load_config(config)
        else:
            if config is None:
                raise ValueError(
                    "a state-dict source needs config= (HF config or config.json) when no "
                    "rollout instance is there to ask"
                )
            cfg = load_config(config)
            state = names.to_inference(dict(source), cfg, contiguous=False)
        return cfg, state

    async def apublish(
        self,
        model: str,
        version: str,
        source: Path | str | Mapping[str, Any],
        *,
        tp: int,
        config: Any = None,
        ipc: bool = False,
        progress: Progress | None = None,
        allow_nonfinite: bool = False,
    ) -> PublishResult:
        t0 = time.perf_counter()
        with _quick_gil_handoff():
            return await self._apublish(
                model, version, source, tp, config, ipc, progress, t0, not allow_nonfinite
            )

    async def _apublish(
        self,
        model: str,
        version: str,
        source: Path | str | Mapping[str, Any],
        tp: int,
        config: Any,
        ipc: bool,
        progress: Progress | None,
        t0: float,
        finite: bool,
    ) -> PublishResult:
        # before the bus and any upload: a bad id is refused with nothing written
        check_model_name(model)
        check_version_name(version)
        bus: Bus | None = None
        try:
            if config is None and not isinstance(source, str | Path):
                bus = await self._connect()
                config = await self._served_config(bus)
            cfg, state = self._load(version, source, config)
            layouts = None if ipc else plan_shards(cfg, state, tp)
            blobs: list[bytes] = []
            man: mf.Manifest | None = None
            bad: NonFiniteWeight | None = None
            if layouts is None:
                try:
                    blobs, man = serialize(cfg, state, tp, model, version, check_finite=finite)
                except NonFiniteWeight as e:
                    if not os.path.lexists(ipc_version_dir(self.ipc_dir, model, version)):
                        raise
                    # published already: the re-publish rules decide (compared below)
                    bad = e
                    blobs, man = serialize(cfg, state, tp, model, version)
            bus = bus or await self._connect()  # one connection for the whole publish
            nc = bus.nc
            await objstore.ensure_ckpt_stream(nc, model)
            if ipc:
                assert man is not None
                if bad is None:
                    uploaded = self._write_ipc(model, version, blobs, man, progress)
                else:  # compared only: a non-finite version is never written unasked
                    d = ipc_version_dir(self.ipc_dir, model, version)
                    if not os.path.lexists(d):
                        raise bad
                    uploaded = self._same_ipc(d, man)
                    _warn_published_nonfinite(model, version, bad)
            else:
                await objstore.ensure_bucket(nc, self.bucket)
                name = ckpt_object_name(model, version, "manifest.json")
                # each shard's chunk subject is chosen now and named in the claim from its
                # first write: a publisher killed mid-upload leaves chunks without a meta,
                # which the next publisher of this version purges when it takes over
                nuids = [objstore.new_nuid(nc) for _ in range(tp)]
                claim = _Claim(nc, self.bucket, name, self.name, nuids)
                old = await claim.take()  # the published manifest, or we hold the claim
                try:
                    if layouts is not None:
                        man, uploaded = await claim.hold_while(
                            self._upload_layouts(
                                nc, model, version, tp, layouts, progress, old, nuids, finite, claim
                            )
                        )
                    else:
                        assert man is not None
                        uploaded = await claim.hold_while(
                            self._upload(
                                nc, model, version, blobs, man, progress, old, nuids, claim
                            )
                        )
                    if uploaded:
                        # last, over our claim only: a version without its manifest does
                        # not exist for the ranks
                        if not await claim.mine():
                            raise claim.lost()
                        await objstore.put_object(
                            nc, self.bucket, name, mf.encode(man), expect_seq=claim.seq
                        )
                except (objstore.ObjectConflict, ClaimLost) as e:
                    if old is None:
                        await asyncio.shield(self._abandon(nc, model, version, tp, claim))
                    lost = (
                        e
                        if isinstance(e, ClaimLost)
                        else ClaimLost(
                            f"{model}/{version}: another publisher took this version over "
                            "while this one was uploading it"
                        )
                    )
                    # the taker may have published these very bytes (a trainer's retry,
                    # a second publisher of one checkpoint): then this publish is the
                    # no-op a re-publish is ("already published"), not a failure
                    taken = await claim.published()
                    if taken is None:
                        raise lost from None
                    try:
                        if layouts is not None:
                            man, uploaded = await self._upload_layouts(
                                nc, model, version, tp, layouts, None, taken, nuids, finite
                            )
                        else:
                            assert man is not None
                            _same_content(taken, man)
                            uploaded = False
                    except VersionConflict:
                        raise lost from None
                    log.warning(
                        "%s/%s: another publisher took this version over and published "
                        "the same content",
                        model,
                        version,
                    )
                except BaseException:
                    if old is None:
                        await asyncio.shield(self._abandon(nc, model, version, tp, claim))
                    raise
            try:
                seq = await self._announce(nc, man)
            except Exception as e:  # noqa: BLE001 - any bus error: said what it means
                # the version is whole in the bucket, only its event is missing: a retry
                # (same content) is a no-op upload that announces it. Before, `rollbus
                # publish` said only "nats: timeout" (or, for a nats error that is not
                # an OSError, printed a traceback)
                denied = _denied_in(e)
                if denied is not None:  # the credentials' permissions: a retry cannot help
                    raise NotAnnounced(
                        f"{model}/{version} is stored but its event was not published: "
                        f"{denied.message} (publishing again cannot announce it: use "
                        f"credentials that may publish there)"
                    ) from e
                raise NotAnnounced(
                    f"{model}/{version} is stored but its event was not published "
                    f"({e!r}): publish it again to announce it"
                ) from e
        finally:
            if bus is not None:
                await bus.close()
        return PublishResult(
            model, version, tp, man.total_bytes, seq, uploaded, time.perf_counter() - t0, ipc
        )

    async def _abandon(self, nc: Any, model: str, version: str, tp: int, claim: _Claim) -> None:
        """A failed or cancelled publish removes what it stored — shards whose put
        completed (their meta still names our chunks) and any chunks left — then
        releases its claim: an unpublished version keeps no bytes in the bucket."""
        with contextlib.suppress(Exception):
            mine = await claim.mine()
            keep: set[str] = set()
            for r in range(tp):
                shard = ckpt_object_name(model, version, rank_shard_file(r, tp))
                seq, info = await objstore.last_meta(nc, self.bucket, shard)
                if info.get("nuid") not in claim.nuids or info.get("deleted"):
                    continue
                if not mine:
                    # the claim was taken over (we stalled past CLAIM_STALE_S) and a put
                    # of ours stored this shard after the new holder's: its published
                    # manifest may name it now (same bytes), so its chunks stay
                    keep.add(info["nuid"])
                    continue
                with contextlib.suppress(objstore.ObjectConflict):
                    deleted = {**info, "deleted": True, "size": 0, "chunks": 0, "digest": ""}
                    await objstore.put_meta_if(nc, self.bucket, shard, deleted, seq)
            await objstore.purge_chunks(nc, self.bucket, [n for n in claim.nuids if n not in keep])
        await claim.release()

    async def _connect(self) -> Bus:
        return await Bus.connect(self.nats_url, "rollbus-publisher", timeout=self.connect_timeout)

    async def served_config(self) -> dict[str, Any]:
        """The HF config of the model the rollout instance serves (``ctl.model_config``):
        what a state dict is sharded by when the trainer passes no ``config``."""
        bus = await self._connect()
        try:
            return await self._served_config(bus)
        finally:
            await bus.close()

    async def _served_config(self, bus: Bus) -> dict[str, Any]:
        rep = await bus.request(Subjects(self.instance).ctl("model_config"), b"{}", timeout=10.0)
        reply = json_decode(rep.data, type=ControlReply)
        if reply.error_code != 200 or not reply.result:
            raise ValueError(f"cannot get the served model config: {reply.error_message}")
        return dict(reply.result["config"])

    async def aversions(self, model: str) -> list[VersionInfo]:
        check_model_name(model)  # before the bus: an empty id is no subject token
        bus = await Bus.connect(self.nats_url, "rollbus-versions", timeout=self.connect_timeout)
        try:
            await objstore.ensure_ckpt_stream(bus.nc, model)
            evs = await objstore.list_versions(bus.nc, model)
        finally:
            await bus.close()
        # a version's place is its first announcement (as every engine orders them): a
        # re-announcement (after the dedup window, or by hand) is not another version
        seen: set[str] = set()
        out = []
        for seq, e in evs:
            if e.version not in seen:
                seen.add(e.version)
                out.append(
                    VersionInfo(seq, e.model, e.version, e.tp, e.total_bytes, e.time, e.publisher)
                )
        return out

    # ------------------------------------------------------------------ steps

    async def _upload_layouts(
        self,
        nc: Any,
        model: str,
        version: str,
        tp: int,
        layouts: list[ShardLayout],
        progress: Progress | None,
        old: mf.Manifest | None,
        nuids: list[str],
        finite: bool = True,
        claim: _Claim | None = None,
    ) -> tuple[mf.Manifest, bool]:
        """Every rank's shard at once: each is written (one copy per byte, hashed as it
        is copied) on its own thread into a small ring of reused memory (:class:`_Ring`)
        while the part already written is being sent; the manifest (with those SHA-256)
        goes last (the caller writes it). ``old``: the version's published manifest.
        ``finite``: each block is checked for NaN/Inf as it is hashed (no pass of its
        own); a non-finite tensor fails the upload, whose chunks the caller purges."""
        loop = asyncio.get_running_loop()
        total = sum(lay.size for lay in layouts)
        shas = [hashlib.sha256() for _ in layouts]
        pool = ThreadPoolExecutor(len(layouts), thread_name_prefix="shard-fill")
        try:
            if old is not None:  # compare content first: hash without uploading
                bad: NonFiniteWeight | None = None
                for check in (finite, False):
                    shas = [hashlib.sha256() for _ in layouts]
                    try:
                        await asyncio.gather(
                            *(
                                loop.run_in_executor(pool, _fill_scratch, lay, sha, check)
                                for lay, sha in zip(layouts, shas, strict=True)
                            )
                        )
                        break
                    except NonFiniteWeight as e:
                        # nothing is published by a re-publish: the re-publish rules
                        # decide (same bytes: a no-op; other bytes: refused), not the
                        # check ("not published" was said of a version that was live)
                        bad = e
                man = _manifest(model, version, tp, layouts, shas)
                _same_content(old, man)
                if bad is not None:
                    _warn_published_nonfinite(model, version, bad)
                if progress:
                    progress(total, total)
                return man, False
            acked = [0] * len(layouts)

            async def one(i: int, lay: ShardLayout) -> None:
                # the shard's bytes at their offsets, in a small ring of reused memory
                took = pool.submit(self._rings.take, lay.size, _ring_size(lay))
                try:
                    ring = await asyncio.wrap_future(took)
                except asyncio.CancelledError:  # the ring still comes: back to the cache
                    took.add_done_callback(self._rings.give_back)
                    raise
                filled = [0]
                wake = asyncio.Event()

                def on_filled(n: int) -> None:  # on the fill thread
                    filled[0] = n
                    loop.call_soon_threadsafe(wake.set)

                # a contiguous tensor's bytes are sent from the tensor itself: only the
                # header and transposed/strided tensors are copied into the ring
                fill = loop.run_in_executor(
                    pool,
                    lambda: lay.fill(
                        ring.buf,
                        shas[i],
                        on_filled,
                        ring.room,
                        skip_direct=True,
                        check_finite=finite,
                    ),
                )
                fill.add_done_callback(lambda _: wake.set())
                # a fill that failed after this upload stopped looking (cancelled: another
                # shard failed first) is marked retrieved here: its error is the one that
                # shard raised, and asyncio would log a traceback for it on stderr
                fill.add_done_callback(lambda f: f.cancelled() or f.exception())

                async def ready(n: int) -> None:
                    while filled[0] < n:
                        if fill.done():
                            fill.result()  # a failed fill ends the upload here
                        wake.clear()
                        if filled[0] >= n or fill.done():
                            continue
                        await wake.wait()

                async def digest() -> str:
                    await fill
                    return shas[i].hexdigest()

                def cb(n: int) -> None:
                    ring.free(n)  # acknowledged: stored by the server, its memory reusable
                    acked[i] = n
                    if progress:
                        progress(sum(acked), total)

                ok = False
                shard = ckpt_object_name(model, version, lay.file)
                try:
                    await objstore.put_object(
                        nc,
                        self.bucket,
                        shard,
                        ring.buf,
                        cb,
                        ready=ready,
                        digest=digest,
                        gather=lay.gather(memoryview(ring.buf).cast("B")),
                        cas=True,
                        nuid=nuids[i],
                        write_meta=claim.writer(shard) if claim is not None else None,
                    )
                    ok = True
                finally:
                    ring.stop()  # a fill waiting for room ends
                    try:
                        if not fill.done():
                            with contextlib.suppress(Exception):
                                await fill
                    finally:  # even when cancelled again while the fill ends
                        if ok and fill.done():
                            self._rings.give(ring)  # nothing refers to its memory any more
                        else:
                            ring.close(False)

            tasks = [asyncio.ensure_future(one(i, lay)) for i, lay in enumerate(layouts)]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:  # one shard failed: stop the others (their chunks are purged)
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            pool.shutdown(wait=False)
        return _manifest(model, version, tp, layouts, shas), True

    async def _upload(
        self,
        nc: Any,
        model: str,
        version: str,
        blobs: list[bytes],
        man: mf.Manifest,
        progress: Progress | None,
        old: mf.Manifest | None,
        nuids: list[str],
        claim: _Claim | None = None,
    ) -> bool:
        if old is not None:
            _same_content(old, man)
            if progress:
                progress(man.total_bytes, man.total_bytes)
            return False
        total, base = man.total_bytes, 0
        for spec, blob, nuid in zip(man.shards, blobs, nuids, strict=True):
            cb = None
            if progress:
                cb = (lambda b: lambda n: progress(b + n, total))(base)  # noqa: B023
            shard = ckpt_object_name(model, version, spec.file)
            await objstore.put_object(
                nc,
                self.bucket,
                shard,
                blob,
                cb,
                cas=True,
                nuid=nuid,
                write_meta=claim.writer(shard) if claim is not None else None,
            )
            base += len(blob)
        return True

    def _write_ipc(
        self,
        model: str,
        version: str,
        blobs: list[bytes],
        man: mf.Manifest,
        progress: Progress | None,
    ) -> bool:
        """Write the version under ``<ipc_dir>/<model>/<version>/``: directories 0700,
        files 0600 (created exclusively, never through a symlink), all written in a
        fresh temporary dir beside it and renamed into place, so a rank never sees half a
        version and nobody else can slip a file in."""
        d = ipc_version_dir(self.ipc_dir, model, version)
        secure_dir(self.ipc_dir)
        secure_dir(d.parent)
        if os.path.lexists(d):
            return self._same_ipc(d, man)
        tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", suffix=".tmp", dir=d.parent))  # 0700
        try:
            done = 0
            for spec, blob in zip(man.shards, blobs, strict=True):
                _write_private(tmp / spec.file, blob)
                done += len(blob)
                if progress:
                    progress(done, man.total_bytes)
            _write_private(tmp / "manifest.json", mf.encode(man))
            try:
                os.rename(tmp, d)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                return self._same_ipc(d, man)  # written meanwhile by another publisher
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return True

    @staticmethod
    def _same_ipc(d: Path, man: mf.Manifest) -> bool:
        """``d`` already exists: False if it holds this content, else VersionConflict."""
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafeIpcDir(f"{d} exists and is not a directory of ours: refusing it")
        fd = os.open(d / "manifest.json", os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            old = mf.decode(f.read(mf.MAX_MANIFEST_BYTES), str(d / "manifest.json"))
        if _digests(old) != _digests(man):
            raise VersionConflict(f"{d} already holds different content")
        return False

    async def _announce(self, nc: Any, man: mf.Manifest) -> int:
        for seq, ev in await objstore.list_versions(nc, man.model):
            if ev.version == man.version:
                return seq  # already announced: idempotent, even past the dedup window
        ev = VersionPublished(
            model=man.model,
            version=man.version,
            tp=man.tp,
            total_bytes=man.total_bytes,
            publisher=self.name,
        )
        return await objstore.publish_version(nc, ev)


# A version is claimed before its first byte is uploaded (see :class:`_Claim`)
CLAIM_REFRESH_S = 5.0  # the holder rewrites its claim this often while it uploads
CLAIM_STALE_S = 15.0  # unchanged this long (3 refreshes missed, as a waiter sees it): taken over
CLAIM_POLL_S = 0.25  # a waiter looks at the claim (or the manifest) this often


class _Claim:
    """One publisher at a time per version: a compare-and-set lease on the version's
    ``manifest.json`` meta subject in the object store.

    Two trainers publishing one version name at once would otherwise both upload
    ``rank<r>-of-<tp>.safetensors`` over each other and each write its manifest: both
    "succeed" and the stored version can pair one's manifest with the other's shards
    (a SHA-256 mismatch on every rank, forever: versions are immutable). So the first
    writes a claim (a *deleted* meta message carrying ``claim``: readers see no object,
    a rank asking for the version still gets 404) with an expected last subject
    sequence, refreshes it every :data:`CLAIM_REFRESH_S` while it uploads, and writes the
    manifest over it with a compare-and-set on the claim's sequence. Any other publisher
    waits until the manifest appears and compares content (identical: a no-op; else
    :class:`VersionConflict`), or takes the claim over when it is released (a failed
    publish) or unchanged for :data:`CLAIM_STALE_S` (a publisher that died). A holder
    that lost its claim (stopped that long) ends at its next refresh and cannot write
    the manifest; each shard's meta is written only if nobody wrote that shard since its
    put began.
    """

    def __init__(
        self, nc: Any, bucket: str, name: str, owner: str, nuids: list[str] | None = None
    ) -> None:
        self.nc, self.bucket, self.name, self.owner = nc, bucket, name, owner
        self.nuids = list(nuids or [])  # the chunk subjects this publisher writes
        self.id = os.urandom(8).hex()
        self.seq = 0
        self.lock = asyncio.Lock()  # a refresh and the manifest's write never overlap
        self.fence = objstore.can_fence(nc)  # the server checks a write against the claim

    def _deleted(self) -> dict[str, Any]:
        """A deleted object's meta as NATS object stores write it: a reader that parses
        every meta (nats-py's ``ObjectStore.list``, ``get_info``, ``put``) needs ``nuid``
        (none: its ``list`` hangs, the others raise ``BadObjectMetaError``, for as long as
        the marker is the name's last meta — for good after a failed publish)."""
        nuid = self.nc._nuid.next().decode()  # no chunk was ever written under it
        return {
            "name": self.name,
            "bucket": self.bucket,
            "nuid": nuid,
            "size": 0,
            "chunks": 0,
            "digest": "",
            "deleted": True,
        }

    def _marker(self) -> dict[str, Any]:
        return {
            **self._deleted(),
            "claim": {
                "owner": self.owner,
                "id": self.id,
                "time": time.time(),
                "nuids": self.nuids,
            },
        }

    async def take(self) -> mf.Manifest | None:
        """Hold the claim (None), or the version's manifest once it is published."""
        loop = asyncio.get_running_loop()
        seen, since = -1, loop.time()
        while True:
            seq, info = await objstore.last_meta(self.nc, self.bucket, self.name)
            if info.get("nuid") and not info.get("deleted"):
                return await self._manifest()
            claim = info.get("claim")
            if isinstance(claim, dict) and claim.get("id") == self.id:
                self.seq = seq  # our own write, whose answer was lost: we hold it
                return None
            if isinstance(claim, dict):  # another publisher is at work
                if seen == -1:  # said once: else the wait (up to 15 s) looks like a hang
                    log.warning(
                        "%s: another publisher (%s) holds this version; waiting for it "
                        "(a claim unchanged for %gs is taken over)",
                        self.name,
                        str(claim.get("owner", "?"))[:64],
                        CLAIM_STALE_S,
                    )
                if seq != seen:
                    seen, since = seq, loop.time()
                if loop.time() - since < CLAIM_STALE_S:
                    await asyncio.sleep(CLAIM_POLL_S)
                    continue
            try:
                self.seq = await objstore.put_meta_if(
                    self.nc, self.bucket, self.name, self._marker(), seq
                )
            except objstore.ObjectConflict:
                continue  # someone else moved first (or our write landed): look again
            if isinstance(claim, dict):  # taken over from a publisher that died
                await self._purge_dead(claim)
            return None

    async def _manifest(self) -> mf.Manifest:
        raw = await objstore.read_object(
            self.nc, self.bucket, self.name, max_size=mf.MAX_MANIFEST_BYTES
        )
        try:
            return mf.decode(bytes(raw), self.name)
        except ControlError as e:  # a foreign writer's, a corrupt store's
            # the version exists (ranks get 422 for it): still immutable; before, this
            # ControlError ended `rollbus publish` with a traceback
            raise VersionConflict(
                f"{e.message}: the version is already published and cannot be "
                "read; versions are immutable: publish a new version"
            ) from None

    async def published(self) -> mf.Manifest | None:
        """The version's manifest if it is published now (e.g. by a taker), else None."""
        try:
            _, info = await objstore.last_meta(self.nc, self.bucket, self.name)
            if info.get("nuid") and not info.get("deleted"):
                return await self._manifest()
        except Exception:  # noqa: BLE001 - cannot tell: the claim was lost, said so
            pass
        return None

    async def _purge_dead(self, claim: dict[str, Any]) -> None:
        """Purge the chunks a dead holder's puts left without a meta (SIGKILL, power
        loss): nothing else ever refers to them. Its puts that did write a meta are
        replaced (and their chunks purged) by ours."""
        nuids = claim.get("nuids")
        if not isinstance(nuids, list):
            return
        try:
            n = await objstore.purge_chunks(self.nc, self.bucket, nuids)
        except Exception as e:  # noqa: BLE001 - the publish goes on; the chunks stay
            log.warning("%s: cannot purge a dead publisher's chunks: %r", self.name, e)
            return
        if n:
            log.info("%s: purged the chunks of %d shard(s) a dead publisher left", self.name, n)

    async def mine(self) -> bool:
        """Whether the last claim is still ours (its sequence then taken): a write whose
        answer was lost (a timeout) may have landed all the same."""
        seq, info = await objstore.last_meta(self.nc, self.bucket, self.name)
        claim = info.get("claim")
        if isinstance(claim, dict) and claim.get("id") == self.id:
            self.seq = seq
            return True
        return False

    async def refresh(self) -> None:
        """Keep the claim alive; :class:`VersionConflict` once it was taken over."""
        while True:
            await asyncio.sleep(CLAIM_REFRESH_S)
            async with self.lock:
                try:
                    self.seq = await objstore.put_meta_if(
                        self.nc, self.bucket, self.name, self._marker(), self.seq
                    )
                except objstore.ObjectConflict:
                    if not await self.mine():
                        raise self.lost() from None
                except Exception as e:  # noqa: BLE001 - a bus hiccup: next period
                    log.warning("cannot refresh the claim on %s: %r", self.name, e)
                    with contextlib.suppress(Exception):
                        await self.mine()

    def writer(self, shard: str) -> Callable[[dict[str, Any], int], Awaitable[None]]:
        """The meta write of ``shard`` (an object of this version): it lands only while
        this claim is the version's last claim write — the server checks the claim's
        sequence in the same write —, else :class:`objstore.ObjectConflict`. So a
        publisher that lost its claim (stalled while another took it over and published)
        can never store a shard over the one the published manifest names: before, a
        put begun after the takeover passed its own compare-and-set (the taker's shard
        was the last write it had seen) and readers got 422 for good."""

        async def write(info: dict[str, Any], seq0: int) -> None:
            async with self.lock:  # no refresh moves the claim's sequence meanwhile
                if not self.fence:
                    # nats-server < 2.11: the claim looked at just before (a stall right
                    # between the two is not covered), the shard's own compare-and-set
                    if not await self.mine():
                        raise objstore.ObjectConflict(f"{shard}: the claim was taken over")
                    await objstore.put_meta_if(self.nc, self.bucket, shard, info, seq0)
                    return
                for again in (False, True):
                    try:
                        await objstore.put_meta_if(
                            self.nc, self.bucket, shard, info, self.seq, on=self.name
                        )
                        return
                    except objstore.ObjectConflict:
                        # a refresh whose answer was lost moved the sequence: still ours?
                        if again or not await self.mine():
                            raise

        return write

    def lost(self) -> ClaimLost:
        return ClaimLost(
            f"{self.name}: another publisher took this version over (this one did not "
            f"refresh its claim for {CLAIM_STALE_S:g}s)"
        )

    async def release(self) -> None:
        """A failed publish lets a waiting publisher take over at once."""
        with contextlib.suppress(Exception):
            await objstore.put_meta_if(
                self.nc,
                self.bucket,
                self.name,
                self._deleted(),
                self.seq,
            )

    async def hold_while(self, coro: Any) -> Any:
        """Run ``coro`` (the upload) while refreshing the claim; a lost claim ends it."""
        work = asyncio.ensure_future(coro)
        keep = asyncio.ensure_future(self.refresh())
        try:
            await asyncio.wait({work, keep}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                keep.result()  # raises VersionConflict (the claim was taken over)
            return work.result()
        finally:
            # never stopped mid-write: its cancel could be lost (asyncio.wait_for inside
            # nats-py's request swallows one that comes with the answer, Python < 3.12: it
            # refreshed for ever, the publish hung), and a write cut off may land unseen
            async with self.lock:
                for t in (work, keep):
                    t.cancel()
            await asyncio.gather(work, keep, return_exceptions=True)


class UnsafeIpcDir(PermissionError):
    """An ipc directory is a symlink, not ours, or writable by others."""


def secure_dir(path: Path) -> None:
    """Create ``path`` 0700 if missing; else it must be a real directory (no symlink),
    owned by us and not world-writable."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeIpcDir(f"{path} is a symlink or not a directory: refusing to write there")
    if st.st_uid != os.geteuid():
        raise UnsafeIpcDir(f"{path} is owned by uid {st.st_uid}, not by us: refusing it")
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeIpcDir(f"{path} is world-writable: refusing it")


def _write_private(path: Path, data: bytes) -> None:
    """A new 0600 file (exclusive create, no symlink followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


SWITCH_INTERVAL = 0.0005  # s, while publishing (CPython's default is 0.005)


@contextlib.contextmanager
def _quick_gil_handoff() -> Iterator[None]:
    """A shorter GIL switch interval while a version is published: the fill threads run
    numpy in Python loops, and with the default 5 ms the event loop, woken to send the
    next chunk, waits up to that long for the GIL each time (measured: the SDK publish
    of the bench's 648 MiB state dict 3.0 s → 2.4 s). Restored afterwards unless
    something else changed it meanwhile."""
    old = sys.getswitchinterval()
    if old <= SWITCH_INTERVAL:
        yield
        return
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        yield
    finally:
        if sys.getswitchinterval() == SWITCH_INTERVAL:
            sys.setswitchinterval(old)


RING_MIN = 32 << 20  # bytes of memory per shard being published (more if a fill block is big)


def _ring_size(lay: ShardLayout) -> int:
    """Room for one fill block plus two windows of chunks in flight (fill never waits on
    acks of chunks it has not let be sent), in whole MiB."""
    need = lay.max_block() + 2 * objstore.PUT_WINDOW * objstore.CHUNK_SIZE
    return -(-max(RING_MIN, need) // objstore.CHUNK_SIZE) * objstore.CHUNK_SIZE


_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


class _Ring:
    """A shard-sized address range (``buf``) backed by only ``ring`` bytes of memory: one
    memfd mapped again and again side by side, so byte ``x`` and byte ``x + ring`` are the
    same memory. The shard is written at its own offsets as into a flat buffer (same
    code, same bytes) and sent as slices of ``buf``; :meth:`room` (on the fill thread)
    blocks until the bytes about to be overwritten were acknowledged (:meth:`free`, on
    the event loop). Chunk acks come in send order, and each chunk was handed to the
    kernel before the next one's ack, so acknowledged memory is memory nobody reads
    any more. No fresh pages per publish: the same ``ring`` bytes, warm in cache."""

    PROT_NONE, PROT_RW = 0, 3
    MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANON, MAP_NORESERVE, MAP_POPULATE = (
        0x01,
        0x02,
        0x10,
        0x20,
        0x4000,
        0x8000,
    )

    def __init__(self, size: int, ring: int) -> None:
        lib = _lib()
        self.size, self.freed, self.stopped, self.mapped = size, 0, False, False
        self.ring = ring = min(ring, -(-max(1, size) // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.span = -(-max(1, size) // ring) * ring
        self.cond = threading.Condition()
        fd = os.memfd_create("rollbus-shard", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, ring)
            base = lib.mmap(
                None,
                self.span,
                self.PROT_NONE,
                self.MAP_PRIVATE | self.MAP_ANON | self.MAP_NORESERVE,
                -1,
                0,
            )
            if base in (None, ctypes.c_void_p(-1).value):
                raise MemoryError(f"cannot reserve {self.span} bytes of address space")
            self.base = base
            for a in range(0, self.span, ring):
                got = lib.mmap(
                    base + a,
                    ring,
                    self.PROT_RW,
                    self.MAP_SHARED | self.MAP_FIXED | self.MAP_POPULATE,
                    fd,
                    0,
                )
                if got != base + a:
                    lib.munmap(base, self.span)
                    raise MemoryError(f"cannot map a {ring}-byte ring (errno {ctypes.get_errno()})")
        finally:
            os.close(fd)  # the mappings keep the memory
        self.mapped = True
        self.reset(size)

    def room(self, upto: int) -> None:
        """Fill thread: wait until bytes up to ``upto`` may be written."""
        need = upto - self.ring
        if self.freed >= need:
            return
        with self.cond:
            while self.freed < need:
                if self.stopped:
                    raise RuntimeError("publish ended")
                self.cond.wait(1.0)

    def free(self, upto: int) -> None:
        """Event loop: the first ``upto`` bytes are acknowledged."""
        with self.cond:
            self.freed = upto
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def close(self, ok: bool) -> None:
        """Unmap (after success: nothing refers to the memory any more). After a failure
        a socket buffer or a fill thread might still hold a slice: the range is replaced
        by zero pages at once (no memory kept) and unmapped when the last reference to
        :attr:`buf` (every slice refers to it) is gone."""
        if not self.mapped:
            return
        self.mapped = False
        lib = _lib()
        if ok:
            lib.munmap(self.base, self.span)
        else:
            lib.mmap(
                self.base,
                self.span,
                self.PROT_RW,
                self.MAP_PRIVATE | self.MAP_ANON | self.MAP_FIXED | self.MAP_NORESERVE,
                -1,
                0,
            )
            weakref.finalize(self.buf, lib.munmap, self.base, self.span)
            del self.buf

    def reset(self, size: int) -> None:
        """Ready for a shard of ``size`` bytes (at most :attr:`span`)."""
        assert size <= self.span
        self.size, self.freed, self.stopped = size, 0, False
        self.buf = _Buf.at(self.base, max(1, size))


class _Buf:
    """``ctypes.c_char * n`` arrays that can be weakly referenced (:meth:`_Ring.close`)."""

    types: dict[int, Any] = {}

    @classmethod
    def at(cls, addr: int, n: int) -> Any:
        t: Any = cls.types.get(n)
        if t is None:
            t = cls.types[n] = type(f"Buf{n}", (ctypes.c_char * n,), {})
        return t.from_address(addr)


class _RingCache:
    """Rings of finished publishes, reused by the next one (a trainer publishes every
    version: the same shard sizes each time). At most :data:`RING_KEEP` are kept."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: list[_Ring] = []

    def take(self, size: int, ring: int) -> _Ring:
        with self.lock:
            for r in self.free:
                if (
                    r.ring == min(ring, -(-max(1, size) // mmap.PAGESIZE) * mmap.PAGESIZE)
                    and size <= r.span
                ):
                    self.free.remove(r)
                    r.reset(size)
                    return r
        return _Ring(size, ring)

    def give_back(self, took: Any) -> None:
        """A ``take`` whose caller was cancelled: its ring is kept for the next one."""
        if not took.cancelled() and took.exception() is None:
            self.give(took.result())

    def give(self, r: _Ring) -> None:
        with self.lock:
            self.free.append(r)
            old = self.free[:-RING_KEEP]
            del self.free[:-RING_KEEP]
        for o in old:
            o.close(True)

    def __del__(self) -> None:
        for r in self.free:
            r.close(True)


RING_KEEP = 8


def _fill_scratch(lay: ShardLayout, sha: Any, finite: bool) -> None:
    """Hash ``lay``'s bytes through a scratch buffer (nothing kept)."""
    buf = mmap.mmap(-1, max(1, lay.size))
    try:
        lay.fill(buf, sha, check_finite=finite)
    finally:
        with contextlib.suppress(BufferError):
            buf.close()


def _manifest(
    model: str, version: str, tp: int, layouts: list[ShardLayout], shas: list[Any]
) -> mf.Manifest:
    specs = [
        mf.ShardSpec(lay.rank, lay.file, lay.size, sha.hexdigest(), lay.tensors)
        for lay, sha in zip(layouts, shas, strict=True)
    ]
    return mf.Manifest(model=model, version=version, tp=tp, shards=specs, created=time.time())


def _digests(m: mf.Manifest) -> list[tuple[int, str]]:
    return sorted((s.rank, s.sha256) for s in m.shards)


def _same_content(old: mf.Manifest, new: mf.Manifest) -> None:
    """:class:`VersionConflict` unless ``new`` is the content ``old`` published."""
    if _digests(old) != _digests(new):
        raise VersionConflict(
            f"{new.model}/{new.version} is already published with different content "
            "(versions are immutable: publish a new version)"
        )


def _warn_published_nonfinite(model: str, version: str, e: NonFiniteWeight) -> None:
    log.warning(
        "%s/%s is already published with this content, which was published with "
        "allow_nonfinite: tensor %s holds %s (in rank %d's shard); nothing changed",
        model,
        version,
        e.tensor,
        e.what,
        e.rank,
    )
