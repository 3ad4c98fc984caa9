"""shared.sharding: views and copies agree for every rule, including fewer kv heads than
ranks (each rank holds the kv head its query heads read), and a published shard holds
exactly what the rank would cut from the full tensor."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load

from services.trainer.shards import serialize
from shared.model_config import ModelConfig
from shared.sharding import full_shapes, init_weights, shard_shape, shard_tensor, shard_view


def cfg(kv: int) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=kv,
                       attention_bias=True)  # fmt: skip


@pytest.mark.parametrize(("kv", "tp"), [(4, 2), (2, 4), (1, 2), (1, 4)])
def test_view_equals_copy_and_is_a_view(kv: int, tp: int) -> None:
    c = cfg(kv)
    full = init_weights(c, 0)
    for name, w in full.items():
        parts = [shard_view(c, name, w, r, tp) for r in range(tp)]
        for r, part in enumerate(parts):
            assert part.shape == shard_shape(c, name, w.shape, r, tp)
            np.testing.assert_array_equal(part, shard_tensor(c, name, w, r, tp))
            assert np.shares_memory(part, w)


@pytest.mark.parametrize(("kv", "tp"), [(1, 2), (2, 4)])
def test_published_shards_replicate_kv_heads(kv: int, tp: int) -> None:
    c = cfg(kv)
    full = init_weights(c, 1)
    blobs, man = serialize(c, full, tp, "m", "v1")
    for r, blob in enumerate(blobs):
        got = load(bytes(blob))
        assert set(got) == set(full_shapes(c))
        for name, w in full.items():
            np.testing.assert_array_equal(got[name], shard_tensor(c, name, w, r, tp))
        assert man.shards[r].tensors["model.layers.0.self_attn.k_proj.weight"].shape == [8, 32]


@pytest.mark.parametrize(("inter", "tp"), [(37, 2), (37, 4), (5, 4), (4, 4)])
def test_mlp_splits_unevenly_and_gathers_back(inter: int, tp: int) -> None:
    """intermediate_size need not divide by tp: the ranks' gate/up rows and down columns
    tile the full tensor in rank order, the first ``inter % tp`` ranks one wider, and
    the published shards hold exactly those parts."""
    c = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=inter,
                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    c.validate_tp(tp)
    full = init_weights(c, 2)
    blobs, _ = serialize(c, full, tp, "m", "v1")
    for name, axis in (("mlp.gate_proj.weight", 0), ("mlp.up_proj.weight", 0),
                       ("mlp.down_proj.weight", 1)):  # fmt: skip
        w = full[f"model.layers.0.{name}"]
        parts = [shard_tensor(c, f"model.layers.0.{name}", w, r, tp) for r in range(tp)]
        sizes = [p.shape[axis] for p in parts]
        assert sizes == [inter // tp + (r < inter % tp) for r in range(tp)]
        np.testing.assert_array_equal(np.concatenate(parts, axis=axis), w)
        for r, blob in enumerate(blobs):
            np.testing.assert_array_equal(load(bytes(blob))[f"model.layers.0.{name}"], parts[r])
    with pytest.raises(ValueError, match="intermediate_size=3 is less than tp=4"):
        ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=3, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=4).validate_tp(4)  # fmt: skip


def test_llama_biases_split_with_their_weights() -> None:
    """llama's attention_bias / mlp_bias: q/k/v and gate/up biases split as their
    weights' rows; o_proj and down_proj biases whole on every rank (added once, after
    the all-reduce)."""
    c = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                    o_proj_bias=True, mlp_bias=True)  # fmt: skip
    shapes = full_shapes(c)
    p = "model.layers.0."
    for name, want in (("self_attn.o_proj.bias", (32,)), ("mlp.down_proj.bias", (32,)),
                       ("mlp.gate_proj.bias", (19,)), ("mlp.up_proj.bias", (19,)),
                       ("self_attn.q_proj.bias", (16,))):  # fmt: skip
        assert shard_shape(c, p + name, shapes[p + name], 0, 2) == want, name
    assert shard_shape(c, p + "mlp.gate_proj.bias", (37,), 1, 2) == (18,)
