"""Split a full HF-named state dict into per-rank safetensors shards plus a manifest.

Used by the publisher (object store) and to write pre-sharded snapshot versions
(``<model>/versions/<V>/rank<r>-of-<tp>.safetensors`` + ``manifest.json``).
"""

from __future__ import annotations

import bisect
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from shared import manifest as mf
from shared import safetensors as st
from shared import sharding
from shared.model_config import ModelConfig
from shared.subjects import rank_shard_file


def shard_state(
    cfg: ModelConfig, state: dict[str, np.ndarray], tp: int
) -> list[dict[str, np.ndarray]]:
    """One dict per rank; raises ``ValueError`` naming a missing or mis-shaped tensor."""
    shapes = _check(cfg, state, tp)
    return [
        {n: sharding.shard_tensor(cfg, n, np.asarray(state[n]), r, tp) for n in shapes}
        for r in range(tp)
    ]


FILL_BLOCK = 4 << 20  # copy (and hash) in blocks this large, while they are in cache
TILE = 256  # a transposed source is copied in TILE × TILE tiles


class NonFiniteWeight(ValueError):
    """A tensor holds NaN or ±Inf: refused by the publisher unless asked to publish it."""

    def __init__(self, name: str, rank: int, what: str) -> None:
        self.tensor, self.rank, self.what = name, rank, what
        super().__init__(
            f"tensor {name} holds {what} (in rank {rank}'s shard): a checkpoint with "
            "non-finite weights is not published (allow_nonfinite=True, or "
            "`rollbus publish --allow-nonfinite`, publishes it anyway)"
        )


# the sign bit off, a 2-byte float's bits at or above its exponent mask are ±Inf or NaN
# (numpy has no bf16, and its float16 isfinite is ~20× slower than this)
_EXP16 = {"float16": 0x7C00, "bfloat16": 0x7F80}


def _nonfinite(block: np.ndarray, kind: str) -> str | None:
    """None when every element of ``block`` is finite, else what was found ("NaN" or
    "Inf"). ``kind``: :func:`shared.safetensors.dtype_name` of its dtype."""
    mask = _EXP16.get(kind)
    if mask is not None:
        if not block.size:
            return None
        low = np.bitwise_and(block.view(np.uint16), 0x7FFF)
        if int(low.max()) < mask:
            return None
        return "NaN" if (low > mask).any() else "Inf"
    # one read, nothing written (measured cheaper than isfinite(...).all()): NaN and Inf
    # carry through a sum, so a finite sum is a finite block; a non-finite one may be an
    # overflow of finite values, which the exact test tells apart; an overflow to +Inf
    # and -Inf in one block sums to NaN ("invalid"): silent too, else a finite checkpoint
    # prints a RuntimeWarning (and fails to publish under `-W error`)
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.reduce(block, axis=None)
    if np.isfinite(total) or np.isfinite(block).all():
        return None
    return "NaN" if np.isnan(block).any() else "Inf"


def _hash_checked(
    buf: memoryview, a: int, n: int, sha: Any, dtype: np.dtype[Any], kind: str
) -> str | None:
    """``sha.update(buf[a:a+n])``, then with ``kind`` the same bytes (whole ``dtype``
    elements) checked by :func:`_nonfinite` while still in cache: no pass of its own."""
    if sha is not None:
        sha.update(buf[a : a + n])
    return _nonfinite(np.frombuffer(buf, dtype, n // dtype.itemsize, a), kind) if kind else None


@dataclass
class ShardLayout:
    """One rank's safetensors file, planned but not yet written: its header and, for each
    tensor, the source array (a view: a slice of the full tensor, possibly transposed)
    and where its bytes go. :meth:`fill` writes it with one copy per byte."""

    rank: int
    file: str
    header: bytes
    size: int
    parts: list[tuple[str, np.ndarray, int]]  # (name, source view, offset in the file)
    tensors: dict[str, mf.TensorSpec] = field(default_factory=dict)

    def fill(
        self,
        buf: Any,
        sha: Any = None,
        on_filled: Callable[[int], None] | None = None,
        room: Callable[[int], None] | None = None,
        skip_direct: bool = False,
        check_finite: bool = False,
    ) -> None:
        """Write the file into ``buf`` (``size`` bytes, writable) in order; hash each block
        right after copying it when ``sha`` is given; ``on_filled(n)`` after every block:
        the first ``n`` bytes are final. ``room(n)``, when given, is called (and may block)
        before a block that ends at byte ``n`` is written: ``buf`` may be a ring whose
        memory is reused (see :meth:`max_block`). Numpy and hashlib release the GIL here.

        ``skip_direct``: the bytes of a C-contiguous source (:meth:`segments`) are not
        copied into ``buf`` (the sender takes them from the source); they are still hashed
        (from the source) and reported by ``on_filled`` in blocks, in order.

        ``check_finite``: the bytes are also checked for NaN/Inf as they are hashed
        (:func:`_hash_checked`: no pass of its own); the first found raises
        :class:`NonFiniteWeight` naming the tensor, before its block is reported."""
        view = memoryview(buf).cast("B")
        if room is not None:
            room(len(self.header))
        view[: len(self.header)] = self.header
        if sha is not None:
            sha.update(self.header)
        done = len(self.header)
        for name, src, off in self.parts:
            kind = st.dtype_name(src.dtype) if check_finite else ""
            if skip_direct and src.flags.c_contiguous:
                raw = _bytes_of(src)
                for a in range(0, len(raw), FILL_BLOCK):
                    n = min(FILL_BLOCK, len(raw) - a)
                    if what := _hash_checked(raw, a, n, sha, src.dtype, kind):
                        raise NonFiniteWeight(name, self.rank, what)
                    done += n
                    if on_filled is not None:
                        on_filled(done)
                continue
            flat = np.frombuffer(view, np.uint8, src.nbytes, off).view(src.dtype)
            dst = flat.reshape(src.shape) if src.ndim else flat
            rows = src.shape[0] if src.ndim > 1 else 1
            step = max(1, FILL_BLOCK // max(1, src.nbytes // max(rows, 1))) if src.ndim > 1 else 1
            tiled = src.ndim == 2 and not src.flags.c_contiguous
            if tiled:  # a transposed view: tiles keep both sides in cache (≈ 3× faster)
                step = max(TILE, step // TILE * TILE)
            for a in range(0, rows, step):
                if room is not None:
                    room(done + (dst[a : a + step].nbytes if src.ndim > 1 else src.nbytes))
                if tiled:
                    for j in range(0, src.shape[1], TILE):
                        for i in range(a, min(rows, a + step), TILE):
                            np.copyto(
                                dst[i : i + TILE, j : j + TILE], src[i : i + TILE, j : j + TILE]
                            )
                    n = dst[a : a + step].nbytes
                elif src.ndim > 1:
                    np.copyto(dst[a : a + step], src[a : a + step])
                    n = dst[a : a + step].nbytes
                else:
                    np.copyto(dst, src)
                    n = src.nbytes
                if what := _hash_checked(view, done, n, sha, src.dtype, kind):
                    raise NonFiniteWeight(name, self.rank, what)
                done += n
                if on_filled is not None:
                    on_filled(done)
        assert done == self.size, (done, self.size)

    def segments(self) -> list[tuple[int, int, memoryview | None]]:
        """The file as ``(start, end, source)`` in order, covering it: ``source`` is the
        bytes of a C-contiguous tensor (the file holds them as they are: a sender may take
        them from there, no copy), None for bytes that :meth:`fill` writes (the header,
        transposed or strided tensors). Adjacent None ranges are merged."""
        out: list[tuple[int, int, memoryview | None]] = [(0, len(self.header), None)]
        for _, src, off in self.parts:
            end = off + src.nbytes
            if src.flags.c_contiguous and src.nbytes:
                out.append((off, end, _bytes_of(src)))
            elif out[-1][2] is None:
                out[-1] = (out[-1][0], end, None)
            else:
                out.append((off, end, None))
        return out

    def gather(self, view: memoryview) -> Callable[[int, int], list[memoryview]]:
        """``gather(a, b)``: the file's bytes ``a:b`` as buffers, in order: slices of the
        sources of :meth:`segments` where they have one, else of ``view`` (where
        :meth:`fill` with ``skip_direct`` wrote them)."""
        segs = self.segments()
        starts = [s for s, _, _ in segs]

        def gather(a: int, b: int) -> list[memoryview]:
            out: list[memoryview] = []
            k = bisect.bisect_right(starts, a) - 1
            while a < b:
                s, e, src = segs[k]
                t = min(b, e)
                if t > a:
                    out.append(view[a:t] if src is None else src[a - s : t - s])
                    a = t
                k += 1
            return out

        return gather

    def max_block(self) -> int:
        """The most bytes :meth:`fill` writes between two ``room`` calls."""
        most = len(self.header)
        for _, src, _ in self.parts:
            if src.ndim > 1:
                rows = src.shape[0]
                step = max(1, FILL_BLOCK // max(1, src.nbytes // max(rows, 1)))
                if src.ndim == 2 and not src.flags.c_contiguous:
                    step = max(TILE, step // TILE * TILE)
                most = max(most, src.nbytes // rows * min(rows, step))
            else:
                most = max(most, src.nbytes)
        return most


def _bytes_of(src: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, as they are (no copy; read-only sources stay so)."""
    return memoryview(src.reshape(-1).view(np.uint8))


def plan_shards(
    cfg: ModelConfig, state: dict[str, np.ndarray], tp: int
) -> list[ShardLayout] | None:
    """Each rank's file, planned without copying anything (None: a dtype only safetensors
    itself can write; then :func:`serialize` falls back to it). The bytes are exactly
    what ``safetensors`` writes for the same shard; bf16 sources (raw 2-byte views,
    :data:`shared.safetensors.BFLOAT16`) are written as BF16, byte for byte."""
    out = []
    shapes = _check(cfg, state, tp)
    for r in range(tp):
        views = {n: _shard_view(cfg, n, np.asarray(state[n]), r, tp) for n in shapes}
        kinds = {n: st.st_dtype(v.dtype) for n, v in views.items()}
        if None in kinds.values():
            return None
        order = sorted(views, key=lambda n: (-st.WRITE_ORDER[str(kinds[n])], n))
        meta: dict[str, Any] = {}
        parts, off = [], 0
        for n in order:
            v = views[n]
            meta[n] = {
                "dtype": kinds[n],
                "shape": list(v.shape),
                "data_offsets": [off, off + v.nbytes],
            }
            parts.append((n, v, off))
            off += v.nbytes
        header = st.encode_header(meta)
        out.append(
            ShardLayout(
                rank=r,
                file=rank_shard_file(r, tp),
                header=header,
                size=len(header) + off,
                parts=[(n, v, len(header) + o) for n, v, o in parts],
                tensors={
                    n: mf.TensorSpec(shape=list(v.shape), dtype=st.dtype_name(v.dtype))
                    for n, v in views.items()
                },
            )
        )
    return out


def _check(cfg: ModelConfig, state: dict[str, np.ndarray], tp: int) -> dict[str, Any]:
    cfg.validate_tp(tp)
    shapes = sharding.full_shapes(cfg)
    missing = [n for n in shapes if n not in state]
    if missing:
        raise ValueError(f"state dict lacks {missing[:5]}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(state[name].shape)}, config says {shape}")
        dt = np.asarray(state[name]).dtype
        # ranks serve float weights only (bf16 arrives as raw uint16 marked BF16)
        if dt.kind != "f" and st.dtype_name(dt) != "bfloat16":
            raise ValueError(f"{name}: dtype {dt.name}, a weight must be floating point")
    return shapes


def _shard_view(cfg: ModelConfig, name: str, full: np.ndarray, r: int, tp: int) -> np.ndarray:
    """:func:`shared.sharding.shard_tensor` without the copy: a view of ``full``."""
    return sharding.shard_view(cfg, name, full, r, tp)


def serialize(
    cfg: ModelConfig,
    state: dict[str, np.ndarray],
    tp: int,
    model: str,
    version: str,
    check_finite: bool = False,
) -> tuple[list[bytes], mf.Manifest]:
    """Safetensors bytes per rank and the manifest describing them (each byte copied
    once, from the source tensors straight into the file, hashed while in cache).
    ``check_finite``: :class:`NonFiniteWeight` for the first NaN/Inf found."""
    layouts = plan_shards(cfg, state, tp)
    if layouts is None:
        if check_finite:  # a rare dtype: a pass of its own
            for r, shard in enumerate(shard_state(cfg, state, tp)):
                for n, a in shard.items():
                    native = np.ascontiguousarray(a, a.dtype.newbyteorder("="))
                    if what := _nonfinite(native, st.dtype_name(a.dtype)):
                        raise NonFiniteWeight(n, r, what)
        return _serialize_slow(cfg, state, tp, model, version)
    blobs: list[bytes] = []
    specs: list[mf.ShardSpec] = []
    for lay in layouts:
        buf = bytearray(lay.size)
        sha = hashlib.sha256()
        lay.fill(buf, sha, check_finite=check_finite)
        blobs.append(buf)  # type: ignore[arg-type]  # a bytearray: bytes-like, no copy
        specs.append(mf.ShardSpec(lay.rank, lay.file, lay.size, sha.hexdigest(), lay.tensors))
    return blobs, mf.Manifest(
        model=model, version=version, tp=tp, shards=specs, created=time.time()
    )


def _serialize_slow(
    cfg: ModelConfig, state: dict[str, np.ndarray], tp: int, model: str, version: str
) -> tuple[list[bytes], mf.Manifest]:
    blobs: list[bytes] = []
    specs: list[mf.ShardSpec] = []
    for r, shard in enumerate(shard_state(cfg, state, tp)):
        blob = save(shard)
        blobs.append(blob)
        specs.append(
            mf.ShardSpec(
                rank=r,
                file=rank_shard_file(r, tp),
                size=len(blob),
                sha256=hashlib.sha256(blob).hexdigest(),
                tensors={
                    n: mf.TensorSpec(shape=list(a.shape), dtype=str(a.dtype))
                    for n, a in shard.items()
                },
            )
        )
    return blobs, mf.Manifest(
        model=model, version=version, tp=tp, shards=specs, created=time.time()
    )


def write_sharded_dir(
    out_dir: Path,
    cfg: ModelConfig,
    state: dict[str, np.ndarray],
    tp: int,
    model: str,
    version: str,
) -> mf.Manifest:
    out_dir.mkdir(parents=True, exist_ok=True)
    blobs, man = serialize(cfg, state, tp, model, version)
    for spec, blob in zip(man.shards, blobs, strict=True):
        (out_dir / spec.file).write_bytes(blob)
    (out_dir / "manifest.json").write_bytes(mf.encode(man))
    return man
