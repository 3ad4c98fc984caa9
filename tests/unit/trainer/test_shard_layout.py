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
