"""One rank's weights: load a version's shard, stage and validate it, commit, free.

A version is loaded by a *source* (the load strategy) into host arrays, checked against
the tensor spec this rank started with (names, shapes, dtypes, sizes; SHA-256 against
the version's manifest unless turned off), kept in staging, and only swapped in on ``commit`` —
the engine commits every rank together or aborts every rank, so a failure anywhere
leaves the previous weights serving everywhere.

Sources:

* ``snapshot`` — version ``V`` is the directory ``<model>/versions/V/``; the model dir
  itself is the version named in its ``version.txt``. A directory holds either
  pre-sharded ``rank<r>-of-<tp>.safetensors`` files (with ``manifest.json``: SHA-256
  verifiable) or HF ``*.safetensors`` files (one, or a sharded set with
  ``model.safetensors.index.json``), from which each rank reads only its slice's bytes.
  bf16 / fp16 / fp32 load everywhere and are converted to the compute dtype (see
  :func:`services.worker.hf_files.compute_dtype`).
* ``object_store`` / ``ipc`` — see :mod:`services.worker.sources`.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.utils.dlpack

from services.worker import hf_files
from shared import manifest as mf
from shared import presence, sharding
from shared import safetensors as st
from shared.errors import BAD_REQUEST, NOT_FOUND, UNPROCESSABLE, ControlError
from shared.model_config import ModelConfig
from shared.redact import public_path
from shared.subjects import rank_shard_file
from shared.versions import snapshot_dir


@dataclass
class LoadedShard:
    """A version's shard for one rank, in host memory, not yet validated."""

    version: str
    arrays: dict[str, np.ndarray]
    files: list[str]  # relative names (model dir / version), never absolute paths
    nbytes: int
    timings: dict[str, Any] = field(default_factory=dict)
    # what the bytes read are known by, per file read (public name -> ``sha256:<hex>``
    # when checked against the manifest, else :func:`stat_pin` or the object's own
    # digest): a reload (wakeup) must find the same, or it would serve other bytes
    # under the same version name. Empty: nothing to compare (tests' sources).
    pin: dict[str, str] = field(default_factory=dict)


Expected = dict[str, mf.TensorSpec] | None  # the served tensors of this rank, if known
# (version, verify_checksum, expected) -> shard. verify_checksum None = the default:
# verify wherever the version has a manifest.
Source = Callable[..., LoadedShard]


def _spec_of(arr: np.ndarray) -> mf.TensorSpec:
    return mf.TensorSpec(shape=list(arr.shape), dtype=st.dtype_name(arr.dtype))


def stat_pin(st: os.stat_result) -> str:
    """A file's identity when no SHA-256 pins its bytes: a file replaced (inode) or
    written in place (mtime, and ctime, which every write sets and nothing sets back)
    gets another. Taken *before* the file is read: a change while it is read then shows
    at the next comparison, never hides behind it."""
    return f"file:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def unchanged_while_read(before: os.stat_result, after: os.stat_result, where: str) -> None:
    """A file read without a SHA-256 to check it against (verify off, or no manifest):
    its :func:`stat_pin` after the read must be the one taken before it, else a write
    during the read may have mixed old and new bytes (what the pin would only catch at
    the next wakeup, after serving them): 422."""
    if stat_pin(before) != stat_pin(after):
        raise ControlError(
            UNPROCESSABLE, f"{where}: changed while read (written or replaced): refused"
        )


@contextmanager
def bound_to_file(src: Path | int, where: str, bind: bool) -> Iterator[tuple[int, os.stat_result]]:
    """The descriptor to read a file through and its stat before the read (the pin's,
    see :func:`stat_pin`): both of one open file, so the bytes read are those of the
    file the pin names — a file renamed over the path meanwhile is not read in its
    place. ``src``: a path (opened here with :func:`shared.safetensors.open_regular`,
    closed on the way out: anything but a regular file is a 422, never waited on) or a
    descriptor already open on it (left open). ``bind``: no SHA-256 will check what is
    read, so the stat must be the same once the read is done
    (:func:`unchanged_while_read`)."""
    if isinstance(src, int):
        fd = src
    else:
        try:  # a FIFO named like a weight file: refused, never waited on
            fd = st.open_regular(src, where)
        except st.NotRegularFile as e:
            raise ControlError(UNPROCESSABLE, str(e)) from None
    try:
        before = os.fstat(fd)
        yield fd, before
        if bind:
            unchanged_while_read(before, os.fstat(fd), where)
    finally:
        if not isinstance(src, int):
            os.close(fd)


def read_shard(
    src: Path | int, where: str, bind: bool, check_size: Callable[[int], None]
) -> tuple[mmap.mmap, os.stat_result]:
    """A shard read whole into private memory (:func:`hf_files.read_file`) and the stat
    it was read under (:func:`bound_to_file`). ``check_size(size)`` raises on a size the
    caller refuses, before anything is allocated. A file cut short since its stat, or
    changed while read when ``bind``, is 422 ``changed while read``; the buffer of a
    refused read is unmapped at once, not when the GC runs."""
    buf: mmap.mmap | None = None
    try:
        with bound_to_file(src, where, bind) as (fd, fst):
            check_size(fst.st_size)
            try:
                buf = hf_files.read_file(fd, fst.st_size, where)
            except OSError as e:  # short: cut short since its stat
                why = e.strerror if e.errno else f"{e} of {fst.st_size}: changed while read"
                raise ControlError(UNPROCESSABLE, f"{where}: cannot read: {why}") from None
    except BaseException:
        if buf is not None:
            buf.close()
        raise
    return buf, fst


def check_pin(loaded: dict[str, str], now: dict[str, str], where: str) -> None:
    """A reload of a version must be of the bytes its first load read (see
    :attr:`LoadedShard.pin`): else 422 naming the first file that changed."""
    # by value: a SHA-256 names the bytes wherever they were found (a version loaded
    # from ipc reloads from the object store once its ipc dir is gone)
    if not loaded or sorted(loaded.values()) == sorted(now.values()):
        return
    changed = [f for f, p in loaded.items() if p not in now.values()] or sorted(now)
    raise ControlError(
        UNPROCESSABLE,
        f"{where}: {changed[0]} changed since the version was loaded: refused (versions "
        "are immutable; update to it again to take its new bytes)",
    )


def read_small(path: Path, limit: int, where: str) -> bytes:
    """A file of at most ``limit`` bytes (a manifest): larger is a 422, unread."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ControlError(UNPROCESSABLE, f"{where}: {size} bytes, more than {limit}")
        return f.read(limit + 1)[:limit]


class SnapshotSource:
    """Load versions from local directories (FastDeploy's ``ipc_snapshot``)."""

    def __init__(
        self, cfg: ModelConfig, model_dir: Path, rank: int, tp: int, dtype: str = "float32"
    ) -> None:
        self.cfg, self.model_dir, self.rank, self.tp = cfg, model_dir, rank, tp
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"compute dtype {dtype!r} (see hf_files.compute_dtype)")
        self.dtype = dtype  # the compute dtype: every version is converted to it

    def _rel(self, p: Path) -> str:
        return public_path(p, self.model_dir) or "."

    def served_spec(self) -> dict[str, mf.TensorSpec]:
        """This rank's tensors as the served config says (shapes of its part, the
        compute dtype): what a pre-sharded dir is checked against when the caller knows
        no spec yet (the initial load), as an HF dir is, tensor by tensor."""
        full = sharding.full_shapes(self.cfg)
        return {
            n: mf.TensorSpec(
                list(sharding.shard_shape(self.cfg, n, full[n], self.rank, self.tp)), self.dtype
            )
            for n in sharding.shard_names(self.cfg)
        }

    def __call__(
        self, version: str, verify_checksum: bool | None, expected: Expected = None
    ) -> LoadedShard:
        try:
            return self._load(version, verify_checksum, expected)
        except OSError as e:  # an unreadable file: its reason, never its absolute path
            raise ControlError(
                UNPROCESSABLE, f"rank {self.rank}: version {version!r}: {e.strerror or e}"
            ) from None

    def _load(self, version: str, verify_checksum: bool | None, expected: Expected) -> LoadedShard:
        t0 = time.perf_counter()
        d = snapshot_dir(self.model_dir, version)
        if d != self.model_dir and (why := presence.snapshot_pending(d, self.tp, [self.rank])):
            # a dir still being copied is not there yet (404: retried), not broken (a
            # 422 auto-update would refuse for good); rule in shared/presence.py
            raise ControlError(
                NOT_FOUND,
                f"rank {self.rank}: version {version!r} is not complete yet in "
                f"{self._rel(d)}: {why} "
                "(still being copied?)",
            )
        shard_file = d / rank_shard_file(self.rank, self.tp)
        manifest_file = d / "manifest.json"
        if presence.sharded(d, self.tp):
            # never unchecked: a pre-sharded model dir whose tensors are not the config's
            # (another vocab, a missing tensor) was served at start, and its spec then
            # refused every right version
            return self._load_sharded(
                version,
                d,
                shard_file,
                manifest_file,
                verify_checksum,
                expected or self.served_spec(),
                t0,
            )
        if verify_checksum:
            raise ControlError(
                BAD_REQUEST,
                f"version {version!r} ({self._rel(d)}) has no manifest.json: "
                "cannot verify checksums",
            )
        return self._load_hf(version, d, t0)

    def _load_sharded(
        self,
        version: str,
        d: Path,
        shard_file: Path,
        manifest_file: Path,
        verify: bool | None,
        expected: Expected,
        t0: float,
    ) -> LoadedShard:
        where = f"rank {self.rank}: {self._rel(shard_file)}"
        spec: mf.ShardSpec | None = None
        if manifest_file.is_file():
            mwhere = self._rel(manifest_file)
            man = mf.decode(read_small(manifest_file, mf.MAX_MANIFEST_BYTES, mwhere), mwhere)
            spec = mf.validate(man, self.rank, self.tp, expected, self._rel(d))
            shard_file = d / spec.file
            where = f"rank {self.rank}: {self._rel(shard_file)}"
            verify = True if verify is None else verify
        elif verify:
            raise ControlError(
                BAD_REQUEST, f"version {version!r} has no manifest.json: cannot verify checksums"
            )
        if not shard_file.exists():  # anything else that is no file: read_shard says so
            raise ControlError(UNPROCESSABLE, f"{where}: shard file is missing")

        def check_size(size: int) -> None:
            if spec is not None and size != spec.size:
                raise ControlError(
                    UNPROCESSABLE, f"{where}: size {size} != manifest size {spec.size}"
                )
            if spec is None:
                mf.check_file_size(size, expected, where)

        timings: dict[str, Any] = {"verified": bool(verify and spec is not None)}
        # the bytes hashed are the bytes parsed and served: one private copy; no hash
        # binds them when unverified, so their file's stat must (read_shard)
        buf, fst = read_shard(shard_file, where, not timings["verified"], check_size)
        size = fst.st_size
        if verify and spec is not None:
            t1 = time.perf_counter()
            digest = hashlib.sha256(buf).hexdigest()
            timings["verify_s"] = time.perf_counter() - t1
            if digest != spec.sha256:
                raise ControlError(UNPROCESSABLE, f"{where}: SHA-256 mismatch with manifest")
        arrays = hf_files.load_buffer(
            buf, where, self.dtype, spec.tensors if spec is not None else None
        )
        if spec is None:  # no manifest said what the file holds: the served spec does
            mf.check_tensors(expected or {}, {k: _spec_of(v) for k, v in arrays.items()}, where)
        timings["load_s"] = time.perf_counter() - t0
        rel = self._rel(shard_file)
        pin = f"sha256:{spec.sha256}" if timings["verified"] and spec is not None else stat_pin(fst)
        return LoadedShard(version, arrays, [rel], size, timings, {rel: pin})

    def _load_hf(self, version: str, d: Path, t0: float) -> LoadedShard:
        try:
            files = st.checkpoint_files(d)
        except ValueError as e:
            raise ControlError(UNPROCESSABLE, f"rank {self.rank}: {self._rel(d)}/{e}") from None
        if not files:
            raise ControlError(
                UNPROCESSABLE, f"rank {self.rank}: no *.safetensors in {self._rel(d)}"
            )
        arrays: dict[str, np.ndarray] = {}
        shapes = sharding.full_shapes(self.cfg)
        wanted = set(sharding.shard_names(self.cfg))
        nbytes = 0
        where = ""

        def plan(name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
            # the header's shape is checked before a byte of the tensor is read
            if tuple(shape) != tuple(shapes[name]):
                raise ControlError(
                    UNPROCESSABLE,
                    f"{where}: {name} has shape {list(shape)}, the served config "
                    f"says {list(shapes[name])}",
                )
            return sharding.shard_part(self.cfg, name, shape, self.rank, self.tp)

        taken: dict[str, str] = {}  # tensor -> the file it was read from
        pin: dict[str, str] = {}
        for f in files:
            where = f"rank {self.rank}: {self._rel(f)}"
            try:
                # no manifest, never verified: only the file's stat binds what is read
                with bound_to_file(f, where, bind=True) as (fd, fst):
                    pin[self._rel(f)] = stat_pin(fst)
                    # only this rank's slices' bytes, converted to the compute dtype
                    part, nread = hf_files.read_slices(fd, wanted, plan, self.dtype, where, taken)
                arrays.update(part)
                taken.update(dict.fromkeys(part, self._rel(f)))
                nbytes += nread
            except (OSError, ValueError) as e:  # the parser's text names the file too
                why = _no_paths(e, f).removeprefix(f"{where}: ")
                raise ControlError(UNPROCESSABLE, f"{where}: cannot read: {why}") from None
        missing = sorted(wanted - set(arrays))
        if missing:
            raise ControlError(
                UNPROCESSABLE, f"rank {self.rank}: version {version!r} lacks tensors {missing[:5]}"
            )
        return LoadedShard(
            version,
            arrays,
            [self._rel(f) for f in files],
            nbytes,
            {"load_s": time.perf_counter() - t0, "verified": False},
            pin,
        )


def _no_paths(e: Exception, path: Path) -> str:
    """An exception's text with the file's absolute path taken out."""
    msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return msg.replace(str(path), path.name)


def to_paddle(arrays: dict[str, np.ndarray]) -> dict[str, paddle.Tensor]:
    """Host arrays -> paddle tensors, without a copy where the memory allows it.

    On CPU a writable, C-contiguous array is handed over through DLPack: the tensor
    uses the array's memory (which lives until the tensor is freed). ``paddle.to_tensor``
    would copy at about a third of memcpy speed. Read-only views (an mmap) get one
    plain copy first. bf16 (raw 2-byte data) goes through ``to_tensor``, which makes it
    a bfloat16 tensor. On an accelerator ``to_tensor`` does the host-to-device copy.
    """
    if paddle.device.get_device() != "cpu":
        return {k: paddle.to_tensor(v) for k, v in arrays.items()}
    out: dict[str, paddle.Tensor] = {}
    for k, v in arrays.items():
        if st.dtype_name(v.dtype) == "bfloat16":  # DLPack would make it a uint16 tensor
            out[k] = paddle.to_tensor(v)
            continue
        if not (v.flags.writeable and v.flags.c_contiguous) or v.dtype.byteorder == ">":
            v = np.array(v, copy=True, order="C")
        out[k] = paddle.utils.dlpack.from_dlpack(v)
    return out


def free_tensors(tensors: dict[str, paddle.Tensor] | None) -> None:
    """Release tensor memory now (to the OS on CPU), not whenever the GC runs."""
    if not tensors:
        return
    for t in tensors.values():
        t._clear_data()
    tensors.clear()


def digest(tensors: dict[str, paddle.Tensor]) -> str:
    """SHA-256 over (name, bytes) of every tensor in name order: equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name].numpy()).tobytes())
    return h.hexdigest()


# a weight set held beside the current one: update id, version, tensors (None: asleep),
# verify_checksum, pin
Held = tuple[str, str, dict[str, paddle.Tensor] | None, bool | None, dict[str, str]]


class WeightStore:
    """Current weights, staged weights and the tensor spec every version must match.

    An update is identified by its ``update_id`` and goes stage → commit → finalize.
    ``commit`` swaps the staged tensors in but keeps the previous ones until
    ``finalize``, so the engine can ``rollback`` the ranks that committed when another
    rank failed to: all ranks end on the new version, or all on the old one. A rolled
    back id is remembered, so a commit that arrives late (a rank that was stalled) is
    refused instead of switching one rank alone. The rank records that id (``revoke``)
    as soon as a rollback *arrives*, on its event loop, not when the rollback's turn on
    the paddle thread comes: a commit queued before it but run after it is refused too.
    """

    def __init__(self, rank: int, source: Source) -> None:
        self.rank = rank
        self.source = source
        self.current: dict[str, paddle.Tensor] | None = None
        self.version = ""
        # how the current version was checked when staged: wakeup reloads it the same way
        # (a version taken with ``verify_checksum: false`` must wake up, not 422)
        self.verify: bool | None = None
        # what the current version's bytes were known by when loaded: wakeup must find
        # the same (LoadedShard.pin), never other bytes under the same version name
        self.pin: dict[str, str] = {}
        self.spec: dict[str, mf.TensorSpec] = {}
        # id, version, tensors (None: staged while the weights sleep, validated only),
        # verify_checksum, pin
        self._staged: Held | None = None
        self._previous: Held | None = None
        self._rolled_back: deque[str] = deque(maxlen=64)
        self._revoke_lock = threading.Lock()  # revoke (event loop) vs commit (paddle thread)

    @property
    def nbytes(self) -> int:
        """Bytes of the current weights; summed once per weight set (a paddle shape call
        per tensor costs about a millisecond per ``status``), cached by its identity."""
        cur = self.current
        if not cur:
            return 0
        cached = getattr(self, "_nbytes", None)
        if cached is None or cached[0] != id(cur):
            total = sum(int(np.prod(t.shape)) * t.element_size() for t in cur.values())
            self._nbytes = cached = (id(cur), total)
        return int(cached[1])

    def load_initial(self, version: str) -> LoadedShard:
        shard = self.source(version, None, None)
        self.spec = {k: _spec_of(v) for k, v in shard.arrays.items()}
        self.current = to_paddle(shard.arrays)
        self.version, self.pin = version, shard.pin
        return shard

    def stage(
        self, version: str, verify_checksum: bool | None, update_id: str = ""
    ) -> dict[str, object]:
        """Load and validate ``version``; keep it staged. Raises ``ControlError``.

        The source is given this rank's tensor spec, so sizes are checked against what
        the served model implies before anything is read."""
        self.abort()
        self.finalize()
        shard = self._load(version, verify_checksum)
        got = {k: _spec_of(v) for k, v in shard.arrays.items()}
        with _released(shard):
            mf.check_tensors(self.spec, got, f"rank {self.rank}: version {version!r}")
        t0 = time.perf_counter()
        if self.current is None:
            # asleep: checked, then freed again; commit records it, wakeup loads it
            shard.arrays.clear()
            self._staged = (update_id, version, None, verify_checksum, shard.pin)
            return {
                "version": version,
                "bytes": shard.nbytes,
                "files": shard.files,
                "loaded": False,
                **shard.timings,
            }
        self._staged = (update_id, version, to_paddle(shard.arrays), verify_checksum, shard.pin)
        shard.timings["to_device_s"] = time.perf_counter() - t0
        return {"version": version, "bytes": shard.nbytes, "files": shard.files, **shard.timings}

    def revoke(self, update_id: str) -> None:
        """Refuse every later commit of ``update_id`` (its rollback arrived). Cheap and
        thread-safe: called on the event loop when the rollback message is received."""
        with self._revoke_lock:
            if update_id not in self._rolled_back:
                self._rolled_back.append(update_id)

    def revoked(self, update_id: str) -> bool:
        with self._revoke_lock:
            return bool(update_id) and update_id in self._rolled_back

    def commit(self, version: str, update_id: str = "") -> None:
        if self.revoked(update_id):
            raise ControlError(409, f"rank {self.rank}: update {update_id} was rolled back")
        if self._staged is None or self._staged[:2] != (update_id, version):
            raise ControlError(409, f"rank {self.rank}: nothing staged for version {version!r}")
        self._previous = (update_id, self.version, self.current, self.verify, self.pin)
        _, _, self.current, self.verify, self.pin = self._staged
        self.version = version
        self._staged = None

    def finalize(self, update_id: str | None = None) -> None:
        """Free the previous weights of a committed update (``None``: whichever)."""
        if self._previous is not None and update_id in (None, self._previous[0]):
            free_tensors(self._previous[2])
            self._previous = None

    def rollback(self, update_id: str) -> bool:
        """Undo ``update_id`` here: drop it if staged, swap back if committed."""
        self.revoke(update_id)
        if self._staged is not None and self._staged[0] == update_id:
            self.abort()
        if self._previous is None or self._previous[0] != update_id:
            return False
        _, version, tensors, verify, pin = self._previous
        self._previous = None
        free_tensors(self.current)
        self.current, self.version, self.verify, self.pin = tensors, version, verify, pin
        return True

    def abort(self) -> None:
        if self._staged is not None:
            free_tensors(self._staged[2])
            self._staged = None

    def free(self) -> None:
        self.abort()
        self.finalize()
        free_tensors(self.current)
        self.current = None

    def reload(self) -> LoadedShard:
        """Load the current version again (wakeup after sleep): the same bytes it was
        loaded from, else 422 (:func:`check_pin`) and the weights stay asleep."""
        shard = self._load(self.version, self.verify)
        where = f"rank {self.rank}: version {self.version!r}"
        with _released(shard):
            check_pin(self.pin, shard.pin, where)
            got = {k: _spec_of(v) for k, v in shard.arrays.items()}
            mf.check_tensors(self.spec, got, where)
        self.current = to_paddle(shard.arrays)
        return shard

    def _load(self, version: str, verify_checksum: bool | None) -> LoadedShard:
        """The source's shard; a refusal is raised without the frames it came through.

        Those frames hold what was read (a pre-sharded shard is one private buffer, a
        pulled one a bytearray), and an exception is often kept in a reference cycle
        (asyncio's executor futures) that only the GC breaks: an asleep rank whose
        wakeup was refused kept the whole shard resident until then."""
        try:
            return self.source(version, verify_checksum, self.spec or None)
        except ControlError as e:
            e.__context__ = e.__cause__ = None  # an error it replaced holds its frames too
            raise e.with_traceback(None) from None


@contextmanager
def _released(shard: LoadedShard) -> Iterator[None]:
    """A shard refused after its load drops its arrays at once (see WeightStore._load):
    the refusal's traceback holds the caller's frame, and with it the shard."""
    try:
        yield
    except BaseException:
        shard.arrays.clear()
        raise
