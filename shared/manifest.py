"""Checkpoint manifest: what a version's shards must contain. Pure.

``manifest.json`` sits beside the shards (``rank<r>-of-<tp>.safetensors``) of one
version, in the object store (``<model>/<version>/manifest.json``) or in a snapshot dir.
It lists, per rank, the file, its byte size, its SHA-256, and each tensor's shape and
dtype, so a rank can validate a shard before it commits it and name what is wrong.

A manifest is untrusted input: :func:`validate` checks it before a single byte of a
shard is read or allocated — plain file names only (no ``/``, ``..``, absolute paths),
one shard per rank, tensors equal to what the served model expects, and a byte size
that fits those tensors (data bytes + a bounded header). A forged size is a 422 at
once, naming rank and file.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import msgspec

from shared.errors import UNPROCESSABLE, ControlError

MAX_MANIFEST_BYTES = 16 << 20  # a manifest object/file larger than this is refused unread

# bytes per element, by numpy dtype name (what TensorSpec.dtype holds)
DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}

_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class TensorSpec(msgspec.Struct):
    shape: list[int]
    dtype: str


class ShardSpec(msgspec.Struct):
    rank: int
    file: str
    size: int
    sha256: str
    tensors: dict[str, TensorSpec]


class Manifest(msgspec.Struct):
    model: str
    version: str
    tp: int
    shards: list[ShardSpec]
    format: str = "rollbus-ckpt/1"
    created: float = 0.0

    def shard(self, rank: int) -> ShardSpec:
        for s in self.shards:
            if s.rank == rank:
                return s
        raise ControlError(
            UNPROCESSABLE, f"manifest of {self.model}/{self.version} has no shard for rank {rank}"
        )

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)


def encode(m: Manifest) -> bytes:
    return msgspec.json.encode(m)


def decode(data: bytes, where: str = "manifest.json") -> Manifest:
    try:
        return msgspec.json.decode(data, type=Manifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ControlError(UNPROCESSABLE, f"{where} is invalid: {e}") from None


def sha256_of(chunks: Iterable[bytes | memoryview]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


def check_tensors(
    expected: dict[str, TensorSpec],
    got: dict[str, TensorSpec],
    where: str,
    stored: bool = False,
) -> None:
    """Raise a 422 naming the first missing, extra or mis-shaped tensor.

    ``stored``: ``got`` is how a checkpoint stores the tensors and ``expected`` the served
    (compute) dtypes, so any float dtype stands for any other (a bf16 or fp16 checkpoint
    is converted to the compute dtype when loaded)."""
    missing = sorted(set(expected) - set(got))
    if missing:
        raise ControlError(UNPROCESSABLE, f"{where}: missing tensors {missing[:5]}")
    extra = sorted(set(got) - set(expected))
    if extra:
        raise ControlError(UNPROCESSABLE, f"{where}: unexpected tensors {extra[:5]}")
    for name, spec in expected.items():
        g = got[name]
        if list(g.shape) != list(spec.shape):
            raise ControlError(
                UNPROCESSABLE, f"{where}: {name} has shape {g.shape}, expected {spec.shape}"
            )
        if g.dtype != spec.dtype and not (
            stored and g.dtype in FLOAT_DTYPES and spec.dtype in FLOAT_DTYPES
        ):
            raise ControlError(
                UNPROCESSABLE, f"{where}: {name} has dtype {g.dtype}, expected {spec.dtype}"
            )


def header_allowance(n_tensors: int) -> int:
    """The most bytes a safetensors header (8-byte length + JSON) of ``n_tensors`` may
    take: generous for names, shapes and a little metadata, tiny next to the data."""
    return 8 + (64 << 10) + 1024 * n_tensors


def tensor_bytes(tensors: dict[str, TensorSpec], where: str) -> int:
    """Data bytes the tensors take (shape × dtype size); 422 on a bad shape or dtype."""
    total = 0
    for name, t in tensors.items():
        size = DTYPE_SIZES.get(t.dtype)
        if size is None or any(d < 0 for d in t.shape):
            raise ControlError(UNPROCESSABLE, f"{where}: {name} has bad dtype/shape {t}")
        n = 1
        for d in t.shape:
            n *= d
        total += n * size
    return total


def check_file_name(name: str, where: str) -> None:
    """A shard file name is a plain name inside the version: no ``/``, ``..``, ``\\``."""
    if not _FILE_NAME.fullmatch(name) or ".." in name:
        raise ControlError(
            UNPROCESSABLE,
            f"{where}: file name {name[:80]!r} is not a plain file name inside the version",
        )


def validate(
    man: Manifest,
    rank: int,
    tp: int,
    expected: dict[str, TensorSpec] | None,
    prefix: str,
) -> ShardSpec:
    """Check the manifest before anything is read or allocated; return ``rank``'s shard.

    ``prefix`` names where the version lives (``<model>/<version>``) for the messages;
    ``expected`` is the served model's tensor spec for this rank (None: not known yet).
    """
    if man.tp != tp:
        raise ControlError(
            UNPROCESSABLE, f"version {man.version!r} is sharded for tp={man.tp}, serving tp={tp}"
        )
    ranks = sorted(s.rank for s in man.shards)
    if ranks != list(range(tp)):
        raise ControlError(
            UNPROCESSABLE, f"{prefix}/manifest.json lists shards for ranks {ranks[:8]}, "
            f"expected one per rank 0..{tp - 1}"
        )
    for s in man.shards:
        check_file_name(s.file, f"rank {s.rank}: {prefix}/manifest.json")
    if len({s.file for s in man.shards}) != len(man.shards):
        raise ControlError(UNPROCESSABLE, f"{prefix}/manifest.json names a file twice")
    spec = man.shard(rank)
    where = f"rank {rank}: {prefix}/{spec.file}"
    if not _SHA256.fullmatch(spec.sha256):
        raise ControlError(UNPROCESSABLE, f"{where}: manifest sha256 is not 64 hex digits")
    if expected is not None:
        check_tensors(expected, spec.tensors, f"{where}: manifest", stored=True)
    data = tensor_bytes(spec.tensors, where)
    limit = data + header_allowance(len(spec.tensors))
    if not data + 8 < spec.size <= limit:
        raise ControlError(
            UNPROCESSABLE,
            f"{where}: manifest size {spec.size} does not fit its tensors "
            f"({data} data bytes: between {data + 9} and {limit}); refused before reading",
        )
    return spec


def check_file_size(size: int, expected: dict[str, TensorSpec] | None, where: str) -> None:
    """A shard with no manifest: its size must fit the served model's tensors (float
    tensors stored in any float dtype, 2 to 8 bytes an element)."""
    if expected is None:
        return

    def stored_as(dtype: str) -> dict[str, TensorSpec]:
        return {
            n: TensorSpec(t.shape, dtype if t.dtype in FLOAT_DTYPES else t.dtype)
            for n, t in expected.items()
        }

    data = tensor_bytes(stored_as("float16"), where)
    limit = tensor_bytes(stored_as("float64"), where) + header_allowance(len(expected))
    if not data + 8 < size <= limit:
        raise ControlError(
            UNPROCESSABLE,
            f"{where}: size {size} does not fit the served model's tensors "
            f"({data} data bytes: between {data + 9} and {limit})",
        )
