"""Read one rank's slices of a HF safetensors checkpoint, in the compute dtype.

``safetensors``' numpy reader knows no bfloat16, and reading a tensor whole to slice
it costs a full copy per rank. Here each file is memory-mapped, the header parsed, and
only this rank's slice of every wanted tensor is copied out and converted: bfloat16
(the upper half of a float32) and float16 become float32, so a bf16 or fp16 snapshot
computes in fp32 on CPU (``ROLLBUS_DTYPE``). A sharded checkpoint
(``model-0000x-of-0000y.safetensors`` + index) is just several files.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

# safetensors dtype -> (raw numpy dtype, convert raw -> float32)
_FLOAT: dict[str, tuple[type, Callable[[np.ndarray], np.ndarray]]] = {
    "F32": (np.float32, lambda a: np.array(a, dtype=np.float32, order="C")),
    "F16": (np.float16, lambda a: a.astype(np.float32, order="C")),
    "F64": (np.float64, lambda a: a.astype(np.float32, order="C")),
    "BF16": (np.uint16, lambda a: (a.astype(np.uint32) << 16).view(np.float32)),
}

COMPUTE_DTYPES = ("float32", "auto")


def compute_dtype(setting: str, device: str = "cpu") -> str:
    """The dtype the model computes in: ``float32``; ``auto`` (the checkpoint's dtype) is
    meant for GPU and resolves to float32 on CPU, where the kernels are fp32."""
    if setting not in COMPUTE_DTYPES:
        raise ValueError(f"dtype {setting!r} is not supported ({', '.join(COMPUTE_DTYPES)})")
    return "float32"


def read_header(path: Path) -> tuple[int, dict[str, dict[str, object]]]:
    """(data offset, tensor entries) of a safetensors file, without reading the data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ValueError(f"not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    return 8 + n, header


def read_slices(
    path: Path,
    wanted: set[str],
    take: Callable[[str, np.ndarray], np.ndarray],
) -> dict[str, np.ndarray]:
    """``take(name, full_view)`` of every wanted tensor in ``path``, as float32 copies.

    ``full_view`` is a zero-copy view of the mapped file in the stored (raw) dtype;
    ``take`` returns the part this rank needs (e.g. a TP slice), and only that part is
    copied and converted. Raises ``ValueError`` on a malformed file or a non-float tensor."""
    start, header = read_header(path)
    names = [k for k in header if k in wanted]
    out: dict[str, np.ndarray] = {}
    if not names:
        return out
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        for name in names:
            entry = header[name]
            dtype = str(entry.get("dtype"))
            if dtype not in _FLOAT:
                raise ValueError(f"tensor {name!r} has dtype {dtype}, expected a float type")
            raw, convert = _FLOAT[dtype]
            shape = [int(x) for x in entry["shape"]]  # type: ignore[attr-defined]
            a, b = (int(x) for x in entry["data_offsets"])  # type: ignore[attr-defined]
            count = int(np.prod(shape)) if shape else 1
            itemsize = np.dtype(raw).itemsize
            if not 0 <= a <= b or start + b > size or b - a != count * itemsize:
                raise ValueError(f"tensor {name!r}: bytes {a}..{b} do not match its shape")
            view = np.frombuffer(mm, dtype=raw, count=count, offset=start + a).reshape(shape)
            out[name] = convert(take(name, view))
            del view
    finally:
        try:
            mm.close()
        except BufferError:  # a view escaped; the GC unmaps it with the last reference
            pass
    return out
