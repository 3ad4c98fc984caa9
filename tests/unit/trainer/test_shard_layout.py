"""Shards written once per byte are exactly what safetensors writes."""

from __future__ import annotations

import hashlib

import numpy as np
from safetensors.numpy import save

from services.tiny_model import TINY_CONFIG
from services.trainer import names, shards
from shared import sharding
from shared.model_config import ModelConfig

CFG = ModelConfig.from_hf(dict(TINY_CONFIG))


def _reference(state: dict[str, np.ndarray], tp: int) -> list[bytes]:
    return [save(s) for s in shards.shard_state(CFG, state, tp)]


def test_serialize_equals_safetensors_and_hashes_match() -> None:
    w = sharding.init_weights(CFG, 3)
    for tp in (1, 2):
        blobs, man = shards.serialize(CFG, w, tp, "m", "v")
        ref = _reference(w, tp)
        assert [bytes(b) for b in blobs] == ref
        assert [s.sha256 for s in man.shards] == [hashlib.sha256(b).hexdigest() for b in ref]
        assert [s.size for s in man.shards] == [len(b) for b in ref]


def test_transposed_views_are_copied_once_into_the_same_bytes() -> None:
    w = sharding.init_weights(CFG, 4)
    views = names.to_inference(names.to_training(w, CFG), CFG, contiguous=False)
    assert any(not a.flags.c_contiguous for a in views.values())  # no copy made yet
    blobs, _ = shards.serialize(CFG, views, 2, "m", "v")
    assert [bytes(b) for b in blobs] == _reference(w, 2)


def test_mixed_dtypes_follow_safetensors_order() -> None:
    w = {k: (v.astype(np.float16) if "norm" in k else v) for k, v in
         sharding.init_weights(CFG, 5).items()}
    for lay in shards.plan_shards(CFG, w, 2) or []:
        buf = bytearray(lay.size)
        seen: list[int] = []
        lay.fill(buf, None, seen.append)
        assert bytes(buf) == save({n: np.ascontiguousarray(v) for n, v, _ in lay.parts})
        assert seen == sorted(seen) and seen[-1] == lay.size  # a growing final prefix


def test_unsupported_dtype_falls_back_to_safetensors() -> None:
    w = {k: v.astype(">f4") for k, v in sharding.init_weights(CFG, 6).items()}  # big-endian
    assert shards.plan_shards(CFG, w, 2) is None
    blobs, man = shards.serialize(CFG, w, 2, "m", "v")
    assert len(blobs) == 2 and man.shards[0].size == len(blobs[0])


def test_direct_bytes_are_hashed_from_the_source_and_gathered_not_copied() -> None:
    """``fill(skip_direct=True)`` copies only the header and the transposed/strided
    tensors; a contiguous tensor's bytes stay in the tensor, are hashed from there, and
    ``gather`` hands them out as slices of it. Hash and gathered bytes equal the file."""
    w = sharding.init_weights(CFG, 8)
    for state in (w, names.to_inference(names.to_training(w, CFG), CFG, contiguous=False)):
        for tp in (1, 2):
            ref = _reference(w, tp)
            for lay, want in zip(shards.plan_shards(CFG, state, tp) or [], ref, strict=True):
                buf = bytearray(lay.size)
                sha = hashlib.sha256()
                seen: list[int] = []
                lay.fill(buf, sha, seen.append, skip_direct=True)
                assert sha.hexdigest() == hashlib.sha256(want).hexdigest()
                assert seen == sorted(seen) and seen[-1] == lay.size
                segs = lay.segments()
                assert segs[0][0] == 0 and segs[-1][1] == lay.size
                assert all(a[1] == b[0] for a, b in zip(segs, segs[1:], strict=False))  # tiled
                direct = sum(e - s for s, e, src in segs if src is not None)
                assert direct > 0  # the embeddings at least
                for s, e, src in segs:
                    if src is not None:  # never written into buf: left to the sender
                        assert not any(buf[s:e]) and bytes(src) == want[s:e]
                gather = lay.gather(memoryview(buf))
                got = b"".join(bytes(p) for a in range(0, lay.size, 1000)
                               for p in gather(a, min(lay.size, a + 1000)))
                assert got == want
