"""Read one rank's weights from safetensors files, in the compute dtype.

The dtype rule lives here, in one place: :func:`compute_dtype`. On CPU the model
computes in float32 (a bf16 or fp16 checkpoint is converted when loaded: bf16 → fp32 is
``uint16 << 16``, exact); on GPU ``ROLLBUS_DTYPE=auto`` (the default) computes in the
checkpoint's own float dtype. Every safetensors header is parsed by
:mod:`shared.safetensors` (strict; bf16 as raw 2-byte data).

HF checkpoints (one ``model.safetensors`` or a sharded ``model-0000x-of-0000y``
set with its ``model.safetensors.index.json``): each rank reads **only the bytes of its
own slice** of every tensor it needs, with ``pread`` into a fresh buffer — one read per
tensor for a split along the first dim (column-parallel weights, stored ``[out, in]``),
one read per row for a split along a later dim (row-parallel weights: each row's part is
contiguous in the file). Nothing is read whole and then sliced; the bytes a rank read are
its reply's ``bytes``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shared import manifest as mf
from shared import safetensors as st
from shared.errors import UNPROCESSABLE, ControlError

COMPUTE_DTYPES = ("float32", "auto")  # ROLLBUS_DTYPE

# (name, full shape) -> (split axis, start, size) of this rank's part, or None: whole
Plan = Callable[[str, tuple[int, ...]], tuple[int, int, int] | None]


def compute_dtype(setting: str, device: str = "cpu", stored: str = "float32") -> str:
    """The dtype the model computes in — the one place this is decided.

    ``float32``: always fp32. ``auto``: fp32 on CPU (the CPU kernels are fp32); on GPU
    the checkpoint's float dtype ``stored`` (bf16 / fp16 / fp32; fp64 computes in fp32)."""
    if setting not in COMPUTE_DTYPES:
        raise ValueError(f"dtype {setting!r} is not supported ({', '.join(COMPUTE_DTYPES)})")
    if setting == "auto" and device == "gpu" and stored in ("bfloat16", "float16"):
        return stored
    return "float32"


def _pread_into(fd: int, dst: memoryview, offset: int) -> None:
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise OSError(f"file ended at byte {offset + done}")
        done += n


def read_part(fd: int, e: st.Entry, part: tuple[int, int, int] | None) -> np.ndarray:
    """The raw bytes of one tensor's part (``(axis, start, size)``, None: whole), read
    with ``pread`` straight into a new array: exactly the part's bytes are read."""
    shape = list(e.shape)
    if part is None:
        axis, start, size = 0, 0, shape[0] if shape else 1
        if not shape:
            out = np.empty((), dtype=e.raw)
            _pread_into(fd, memoryview(out.reshape(1)).cast("B"), e.start)
            return out
    else:
        axis, start, size = part
    if not 0 <= axis < len(shape) or not 0 <= start <= start + size <= shape[axis]:
        raise ValueError(f"part {part} does not fit shape {shape}")
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64)) * e.raw.itemsize
    out_shape = [*shape[:axis], size, *shape[axis + 1 :]]
    out = np.empty(out_shape, dtype=e.raw)
    rows = memoryview(out.reshape(max(outer, 1), -1) if out.size else out).cast("B")
    run = size * inner  # contiguous bytes of the part per outer index
    stride = shape[axis] * inner
    for i in range(outer if out.size else 0):
        _pread_into(fd, rows[i * run : (i + 1) * run], e.start + i * stride + start * inner)
    return out


def read_slices(
    src: Path | int,
    wanted: set[str],
    plan: Plan,
    dtype: str = "float32",
    where: str | None = None,
    taken: dict[str, str] | None = None,
) -> tuple[dict[str, np.ndarray], int]:
    """This rank's part of every wanted tensor in ``src`` (a path, or a descriptor
    open on the file: read with ``pread``, left open), in ``dtype``, and the number
    of bytes read from the file. ``plan(name, full_shape)`` checks the shape and says
    which part; only those bytes are read. ``taken``: wanted tensors already read from
    another file of the checkpoint (name -> that file): one here too is an error, since
    which copy is meant depends on the reader (a stale full file beside a sharded set,
    a shard holding a tensor the index maps elsewhere). Raises ``ValueError`` on a
    malformed file, a non-float tensor or such a duplicate."""
    if not isinstance(src, int):
        with open(src, "rb") as f:
            return read_slices(f.fileno(), wanted, plan, dtype, where or src.name, taken)
    where = where or f"fd {src}"
    out: dict[str, np.ndarray] = {}
    nread = 0
    header = st.read_header_fd(src, where)
    for name, e in header.tensors.items():
        if taken and name in taken:
            raise ValueError(f"tensor {name!r} is also in {taken[name]}: refused")
        if name not in wanted:
            continue
        if e.dtype_name not in st.FLOATS:
            raise ValueError(f"tensor {name!r} has dtype {e.dtype_name}, expected a float type")
        raw = read_part(src, e, plan(name, e.shape))
        nread += raw.nbytes
        out[name] = st.convert(raw, dtype)
    return out, nread


def load_buffer(
    buf: Any, where: str, dtype: str, stored: dict[str, mf.TensorSpec] | None = None
) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors buffer (a pulled shard, a shard file read whole) in the
    compute ``dtype``: float tensors converted, others as zero-copy views; 422 naming
    the file and tensor when malformed. ``stored``: the manifest's tensors (names,
    shapes, stored dtypes) the header must equal before anything is converted."""
    try:
        header = st.parse(buf, where)
    except st.SafetensorsError as e:
        raise ControlError(UNPROCESSABLE, str(e)) from None
    if stored is not None:
        got = {n: mf.TensorSpec(list(e.shape), e.dtype_name) for n, e in header.tensors.items()}
        mf.check_tensors(stored, got, where)
    out: dict[str, np.ndarray] = {}
    # in file order, so that a run of converted tensors is given back whole, the pages
    # two neighbours share included (see _drop_pages); kept views stay resident
    private = isinstance(buf, mmap.mmap)
    lo = _page_up(header.data_start)  # below: the header or a kept view, or given back
    for name, e in sorted(header.tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        v = st.view(buf, e)
        if e.dtype_name not in st.FLOATS:
            out[name] = v
            lo = max(lo, _page_up(e.end))
            continue
        out[name] = c = st.convert(v, dtype)
        if np.may_share_memory(c, v):  # not converted: a view, kept
            lo = max(lo, _page_up(e.end))
        elif private:
            hi = e.end // mmap.PAGESIZE * mmap.PAGESIZE
            if hi > lo:
                _drop_pages(buf, lo, hi)
                lo = hi
    return {name: out[name] for name in header.tensors}


def _page_up(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _drop_pages(buf: mmap.mmap, lo: int, hi: int) -> None:
    """Give back pages ``[lo, hi)`` of ``buf``: bytes of tensors already converted
    (hashed before, never read again). A bf16 / fp16 shard read whole (:func:`read_file`)
    otherwise stayed resident beside its fp32 result until the load ended: a peak of
    1.5x the weights, where the ipc mapping it replaced cost nothing beside them.
    ``buf`` is :func:`read_file`'s private anonymous memory: a dropped page reads back
    as zeros, never as other bytes. Whole runs, not each tensor's inner pages: a huge
    page (see :func:`_huge_pages`) is freed only once none of it is mapped. The run is
    marked no-huge-pages first: khugepaged collapses a huge-page-eligible range that has
    any page left back into a whole 2 MiB page, zero-filling what was given back (seen:
    a dropped run resident again mid-load)."""
    nohuge = getattr(mmap, "MADV_NOHUGEPAGE", None)
    try:
        if nohuge is not None:
            buf.madvise(nohuge, lo, hi - lo)
        buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except OSError:  # only memory: the load goes on
        pass


def read_file(src: Path | int, size: int, where: str) -> mmap.mmap:
    """The first ``size`` bytes (the size checked) of a file, read into private anonymous
    memory (``pread``: one copy, which paddle then takes without another). ``src``: its
    path, or a descriptor already open on it (the ipc strategy's, opened confined; read
    with ``pread``, left open). Not a mapping of the file: tensors that were views of
    one touched pages past its end when the file was cut short meanwhile (``cp`` over a
    version truncates first, a trainer rewrites its ipc dir) — SIGBUS, the rank died —
    and a SHA-256 of the mapping did not bind what it held when copied later. A file
    shorter than ``size`` is ``OSError``."""
    if size == 0:
        raise ControlError(UNPROCESSABLE, f"{where}: not a valid safetensors file: empty")
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    _huge_pages(buf)
    try:
        # released on the way out, failed read or not: a view still held by the error's
        # frames made ``close`` below raise BufferError instead of the read's error
        with memoryview(buf) as view:
            if isinstance(src, int):
                _pread_into(src, view, 0)
            else:
                with open(src, "rb") as f:
                    _pread_into(f.fileno(), view, 0)
    except BaseException:
        buf.close()
        raise
    return buf


def _huge_pages(buf: mmap.mmap) -> None:
    """Ask for transparent huge pages (THP is often ``madvise``-only, as numpy asks for
    its large arrays): the read faults the buffer in 2 MiB at a time, not 4 KiB — a
    324 MiB shard read 2.3× faster here (0.35 → 0.14 s), faster than the mapping plus
    numpy copy it replaced (0.27 s). Only a hint: a kernel without THP refuses it."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:
            pass
