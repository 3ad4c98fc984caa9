"""Checkpoint manifest: what a version's shards must contain. Pure.

``manifest.json`` sits beside the shards (``rank<r>-of-<tp>.safetensors``) of one
version, in the object store (``<model>/<version>/manifest.json``) or in a snapshot dir.
It lists, per rank, the file, its byte size, its SHA-256, and each tensor's shape and
dtype, so a rank can validate a shard before it commits it and name what is wrong.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgspec

from shared.errors import UNPROCESSABLE, ControlError


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


def check_tensors(expected: dict[str, TensorSpec], got: dict[str, TensorSpec], where: str) -> None:
    """Raise a 422 naming the first missing, extra or mis-shaped tensor."""
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
        if g.dtype != spec.dtype:
            raise ControlError(
                UNPROCESSABLE, f"{where}: {name} has dtype {g.dtype}, expected {spec.dtype}"
            )
