"""Safetensors files: the one header parser, raw tensor views and float conversion.

Every reader of a safetensors file in rollbus goes through :func:`parse` (a buffer: a
downloaded shard, a mapped file) or :func:`read_header` (a file, without reading its
data): the worker's object-store and ipc sources, the snapshot reader, the HF slice
reader and the publisher. Untrusted input, so the parse is strict, as ``safetensors``
itself is (stricter in one point: a name twice in a header object is refused, where it
keeps the last): an 8-byte header length within :data:`MAX_HEADER_BYTES` and the file; a
JSON object; every tensor with a known dtype, a shape of non-negative ints and byte offsets
whose length is exactly shape × itemsize; the tensors' byte ranges contiguous from the
start of the data to the end of the file (no gap, no overlap, nothing trailing). Every
error is a :class:`SafetensorsError` naming the file (``where``) and the tensor.

bfloat16 has no numpy dtype: a BF16 tensor is viewed as 2-byte raw data, dtype
:data:`BFLOAT16` (``uint16`` carrying a marker numpy keeps through slices, transposes
and copies), so slicing and writing it are exact and :func:`dtype_name` still says
``bfloat16``. :func:`convert` turns a raw float tensor into the compute dtype
(bf16 → fp32 is ``uint16 << 16``, exact). Pure: numpy only, no paddle.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header

# bfloat16 as raw 2-byte data: uint16 with a marker (numpy keeps dtype metadata on views)
BFLOAT16 = np.dtype(np.uint16, metadata={"safetensors": "BF16"})

# safetensors dtype -> (numpy dtype name as in manifests, raw numpy dtype)
DTYPES: dict[str, tuple[str, np.dtype[Any]]] = {
    "F64": ("float64", np.dtype("<f8")),
    "F32": ("float32", np.dtype("<f4")),
    "F16": ("float16", np.dtype("<f2")),
    "BF16": ("bfloat16", BFLOAT16),
    "I64": ("int64", np.dtype("<i8")),
    "I32": ("int32", np.dtype("<i4")),
    "I16": ("int16", np.dtype("<i2")),
    "I8": ("int8", np.dtype("i1")),
    "U64": ("uint64", np.dtype("<u8")),
    "U32": ("uint32", np.dtype("<u4")),
    "U16": ("uint16", np.dtype("<u2")),
    "U8": ("uint8", np.dtype("u1")),
    "BOOL": ("bool", np.dtype("?")),
}
_BY_NAME = {name: st for st, (name, _) in DTYPES.items()}
# the order safetensors writes tensors in: by dtype (this order, larger first), then name
WRITE_ORDER = {
    d: i
    for i, d in enumerate(
        ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]
    )
}
FLOATS = ("float64", "float32", "float16", "bfloat16")


class SafetensorsError(ValueError):
    """A malformed safetensors file; the message names the file and the tensor."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype, shape and byte range (offsets from the file's
    start, header included)."""

    dtype: str  # safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def dtype_name(self) -> str:
        """The numpy dtype name (``bfloat16`` for BF16), as manifests write it."""
        return DTYPES[self.dtype][0]

    @property
    def raw(self) -> np.dtype[Any]:
        return DTYPES[self.dtype][1]

    @property
    def count(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    data_start: int  # 8 + header length
    size: int  # the file's size
    tensors: dict[str, Entry]  # in file order
    metadata: dict[str, Any]


def _fail(where: str, what: str) -> SafetensorsError:
    return SafetensorsError(f"{where}: not a valid safetensors file: {what}")


def header_length(first8: bytes | memoryview, size: int, where: str) -> int:
    """The JSON header's length from a file's first 8 bytes; checked against the bound
    and against the file's ``size``."""
    if size < 8 or len(first8) < 8:
        raise _fail(where, f"{size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n > MAX_HEADER_BYTES:
        raise _fail(where, f"header length {n} is more than {MAX_HEADER_BYTES}")
    if n > size - 8:
        raise _fail(where, f"header length {n} runs past the end of the file ({size} bytes)")
    return int(n)


def parse_header(raw: bytes, size: int, where: str) -> Header:
    """Validate the JSON header ``raw`` of a file of ``size`` bytes (see module doc)."""
    start = 8 + len(raw)
    try:
        obj = json.loads(raw, object_pairs_hook=_unique)
    except _Duplicate as dup:
        # JSON leaves a repeated name undefined; safetensors and json keep the last: a
        # tensor named twice could mean other bytes to another reader of the same file
        raise _fail(where, f"{dup.name!r} appears twice in one header object") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise _fail(where, f"header is not JSON ({err})") from None
    if not isinstance(obj, dict):
        raise _fail(where, "header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise _fail(where, "__metadata__ is not an object")
    data_len = size - start
    tensors: dict[str, Entry] = {}
    for name, t in obj.items():
        what = f"tensor {name!r}"
        if not isinstance(t, dict):
            raise _fail(where, f"{what}: entry is not an object")
        dtype = t.get("dtype")
        if dtype not in DTYPES:
            raise _fail(where, f"{what}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        shape, offsets = t.get("shape"), t.get("data_offsets")
        if not isinstance(shape, list) or not all(_uint(d) for d in shape):
            raise _fail(where, f"{what}: shape {shape!r} is not a list of non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_uint, offsets))):
            raise _fail(where, f"{what}: data_offsets {offsets!r} are not two non-negative ints")
        a, b = offsets
        if not a <= b <= data_len:
            raise _fail(where, f"{what}: bytes {a}..{b} lie outside the data ({data_len} bytes)")
        e = Entry(dtype, tuple(shape), start + a, start + b)
        if e.count * e.raw.itemsize != b - a:
            raise _fail(
                where,
                f"{what}: shape {list(shape)} × {dtype} is {e.count * e.raw.itemsize} bytes, "
                f"its offsets {a}..{b} hold {b - a}",
            )
        tensors[name] = e
    end = start
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start != end:
            kind = "overlap the previous tensor" if e.start < end else "leave a gap before them"
            raise _fail(
                where,
                f"tensor {name!r}: bytes {e.start - start}..{e.end - start} {kind} "
                f"(which ends at {end - start})",
            )
        end = e.end
    if end != size:
        raise _fail(where, f"{size - end} trailing bytes after the last tensor")
    return Header(start, size, tensors, meta)


class _Duplicate(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def parse(buf: Any, where: str) -> Header:
    """The header of a whole safetensors file held in ``buf`` (bytes, mmap, ...)."""
    view = memoryview(buf).cast("B")
    n = header_length(view[:8], len(view), where)
    return parse_header(bytes(view[8 : 8 + n]), len(view), where)


class NotRegularFile(ValueError):
    """A weight file's name given to a FIFO, directory, device or socket."""


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: Path | str, where: str) -> int:
    """A descriptor open for reading on the regular file at ``path`` (a symlink is
    followed: an HF cache's snapshot files are links into its blobs), else
    :class:`NotRegularFile` naming ``where`` (``OSError`` when it cannot be opened).
    Opened ``O_NONBLOCK`` and checked with ``fstat``: a plain open of a FIFO named like a
    weight file waits for a writer for good (a rank's start hung in
    :func:`checkpoint_dtype`); the flag changes nothing for a regular file's reads."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((k for test, k in _KINDS if test(mode)), "special")
            raise NotRegularFile(f"{where}: {kind}, not a regular file: refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(path: Path | str, where: str | None = None) -> Header:
    """The header of the file at ``path``, reading only the header's bytes;
    :class:`NotRegularFile` unless it is a regular file (see :func:`open_regular`)."""
    where = where or Path(path).name
    fd = open_regular(path, where)
    try:
        return read_header_fd(fd, where)
    finally:
        os.close(fd)


def read_header_fd(fd: int, where: str) -> Header:
    """The header of the open file ``fd`` (``pread``: its position is not moved)."""
    size = os.fstat(fd).st_size
    n = header_length(os.pread(fd, 8, 0), size, where)
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise _fail(where, f"header cut short ({len(raw)} of {n} bytes)")
    return parse_header(raw, size, where)


def min_size(fd: int, size: int) -> tuple[int, bool] | None:
    """How long the open file ``fd`` (``size`` bytes) must be at least, as far as its
    own bytes tell — what a file still being copied lacks: ``(8, False)`` while its
    header length is not all there, ``(8 + n, False)`` while its JSON header is not,
    else ``(8 + n + the end of its tensors' data, True)``. None: it can never be a
    safetensors file (a header length past :data:`MAX_HEADER_BYTES`, a header that is
    not JSON) — its load says why. No other check: this is not :func:`parse_header`."""
    if size < 8:
        return 8, False
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > MAX_HEADER_BYTES:
        return None
    if n > size - 8:
        return 8 + n, False
    try:
        head = json.loads(os.pread(fd, n, 8))
    except (ValueError, UnicodeDecodeError):
        return None
    ends = [
        e
        for t in (head.values() if isinstance(head, dict) else ())
        if isinstance(t, dict)
        and isinstance(offs := t.get("data_offsets"), list)
        and len(offs) == 2
        and isinstance(e := offs[1], int)
    ]
    return 8 + n + max(ends, default=0), True


def view(buf: Any, e: Entry) -> np.ndarray:
    """A zero-copy view of one tensor of a parsed ``buf``, in its raw dtype."""
    return np.frombuffer(buf, dtype=e.raw, count=e.count, offset=e.start).reshape(e.shape)


def views(buf: Any, header: Header) -> dict[str, np.ndarray]:
    return {name: view(buf, e) for name, e in header.tensors.items()}


def load(buf: Any, where: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors buffer as a zero-copy view, after :func:`parse`."""
    return views(buf, parse(buf, where))


def dtype_name(dt: np.dtype[Any]) -> str:
    """numpy's name of ``dt``, except ``bfloat16`` for :data:`BFLOAT16` data."""
    if dt.metadata and dt.metadata.get("safetensors") == "BF16":
        return "bfloat16"
    return dt.name


def st_dtype(dt: np.dtype[Any]) -> str | None:
    """The safetensors name of a numpy dtype (little-endian only), or None."""
    if dt.byteorder == ">":
        return None
    return _BY_NAME.get(dtype_name(dt))


def convert(a: np.ndarray, target: str) -> np.ndarray:
    """A raw float tensor (float64/32/16 or :data:`BFLOAT16`) as a fresh C-contiguous
    array in ``target`` (``float32``, ``float16`` or ``bfloat16`` — the latter kept as
    raw 2-byte data). An array already in ``target`` is copied only if not contiguous."""
    src = dtype_name(a.dtype)
    if src not in FLOATS:
        raise ValueError(f"dtype {src} is not a float type")
    if src == target:
        return a if a.flags.c_contiguous else np.ascontiguousarray(a)
    if src == "bfloat16":
        wide = np.empty(a.shape, dtype=np.uint32)
        np.left_shift(a, 16, out=wide, dtype=np.uint32)  # exact: bf16 is fp32's upper half
        f32 = wide.view(np.float32)
        return f32 if target == "float32" else f32.astype(target, order="C")
    if target == "bfloat16":  # round to nearest even, as torch / paddle do (NaN kept NaN)
        f = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        rounded = (f + np.uint32(0x7FFF) + ((f >> 16) & np.uint32(1))) >> 16
        out = rounded.astype(np.uint16)
        nan = np.isnan(f.view(np.float32))
        out[nan] = (f[nan] >> 16).astype(np.uint16) | np.uint16(0x40)
        return out.view(BFLOAT16)
    return a.astype(target, order="C")


INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20


def checkpoint_files(d: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint dir: those its
    ``model.safetensors.index.json`` names (plain file names inside ``d``), else every
    ``*.safetensors``. ``ValueError`` on a bad index."""
    try:  # never waited on: a FIFO there is refused (open_regular)
        fd = open_regular(d / INDEX_FILE, INDEX_FILE)
    except FileNotFoundError:
        return sorted(d.glob("*.safetensors"))
    except OSError as e:
        raise ValueError(f"{INDEX_FILE}: cannot open: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if os.fstat(fd).st_size > MAX_INDEX_BYTES:
            raise ValueError(f"{INDEX_FILE} is larger than {MAX_INDEX_BYTES} bytes")
        raw = f.read(MAX_INDEX_BYTES + 1)
    try:
        names = set(json.loads(raw)["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{INDEX_FILE}: no valid weight_map ({e})") from None
    for n in names:
        if not isinstance(n, str) or "/" in n or "\\" in n or n in ("", ".", ".."):
            # an absolute path is not echoed (a load's 422 names no absolute path)
            absolute = isinstance(n, str) and n.startswith(("/", "\\"))
            shown = f"an absolute path to {Path(n).name!r}" if absolute else f"{str(n)[:80]!r}"
            raise ValueError(f"{INDEX_FILE}: {shown} is not a file name inside the dir")
    return sorted(d / n for n in names)


def checkpoint_dtype(files: list[Path]) -> str:
    """The float dtype holding most of the bytes of ``files`` (``float32`` if none)."""
    count: dict[str, int] = {}
    for f in files:
        try:
            header = read_header(f)
        except (OSError, ValueError):
            continue  # reported when the file is loaded
        for e in header.tensors.values():
            if e.dtype_name in FLOATS:
                count[e.dtype_name] = count.get(e.dtype_name, 0) + e.nbytes
    return max(count, key=lambda k: count[k]) if count else "float32"


def encode_header(meta: dict[str, Any]) -> bytes:
    """The 8-byte length and JSON header (space-padded to 8 bytes) of a file whose
    tensors are ``meta`` (``{name: {"dtype", "shape", "data_offsets"}}``)."""
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head
