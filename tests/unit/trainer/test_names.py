"""Name mapping round trip, transposes, and the pure logic of checkpoint loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from services.engine.autoupdate import VersionIndex, durable_name, newest
from services.tiny_model import TINY_CONFIG
from services.trainer import names
from services.worker.sources import parse_safetensors
from shared import sharding
from shared.errors import ControlError
from shared.messages import VersionPublished
from shared.model_config import ModelConfig

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_mapping_is_a_bijection_with_training_names() -> None:
    to_train = names.get_name_mappings_to_training(CFG)
    to_inf = names.get_name_mappings_to_inference(CFG)
    assert set(to_train) == set(sharding.full_shapes(CFG))
    assert {v: k for k, v in to_train.items()} == to_inf
    assert to_train["model.embed_tokens.weight"] == "llama.embed_tokens.weight"
    assert to_train["model.layers.1.self_attn.q_proj.weight"] == (
        "llama.layers.1.self_attn.q_proj.weight"
    )
    assert to_train["lm_head.weight"] == "lm_head.weight"
    assert to_train["model.norm.weight"] == "llama.norm.weight"
    qwen = ModelConfig(**{**CFG.__dict__, "attention_bias": True})
    assert names.get_name_mappings_to_training(qwen)["model.layers.0.self_attn.k_proj.bias"] == (
        "qwen2.layers.0.self_attn.k_proj.bias"
    )


def test_transposed_set() -> None:
    assert names.is_transposed("model.layers.0.mlp.down_proj.weight")
    assert names.is_transposed("model.layers.3.self_attn.o_proj.weight")
    assert names.is_transposed("lm_head.weight")
    assert not names.is_transposed("model.embed_tokens.weight")
    assert not names.is_transposed("model.layers.0.self_attn.q_proj.bias")
    assert not names.is_transposed("model.layers.0.input_layernorm.weight")


def test_round_trip_values_and_layout() -> None:
    hf = sharding.init_weights(CFG, seed=3)
    train = names.to_training(hf, CFG)
    # paddle Linear layout: [in, out]
    assert train["llama.layers.0.mlp.gate_proj.weight"].shape == (16, 24)
    assert train["lm_head.weight"].shape == (16, 64)
    assert train["llama.embed_tokens.weight"].shape == (64, 16)
    back = names.to_inference(train, CFG)
    assert set(back) == set(hf)
    for k in hf:
        assert back[k].shape == hf[k].shape and np.array_equal(back[k], hf[k]), k


def test_to_inference_accepts_paddle_and_names_problems() -> None:
    import paddle

    hf = sharding.init_weights(CFG, seed=4)
    train = {k: paddle.to_tensor(v) for k, v in names.to_training(hf, CFG).items()}
    back = names.to_inference(train, CFG)
    assert np.array_equal(
        back["model.layers.1.mlp.up_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    )
    train.pop("llama.norm.weight")
    with pytest.raises(ValueError, match="llama.norm.weight"):
        names.to_inference(train, CFG)
    with pytest.raises(ValueError, match="unknown"):
        names.to_inference({**names.to_training(hf, CFG), "llama.extra": np.zeros(1)}, CFG)


def test_parse_safetensors_views_and_validation() -> None:
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int64)}
    blob = bytearray(save(arrays))
    got = parse_safetensors(blob, "x")
    assert set(got) == {"a", "b"} and np.array_equal(got["a"], arrays["a"])
    assert np.shares_memory(got["a"], np.frombuffer(blob, np.uint8))  # zero copy
    with pytest.raises(ControlError, match="x: not a valid safetensors") as e:
        parse_safetensors(blob[:-4], "x")
    assert e.value.code == 422
    with pytest.raises(ControlError, match="not a valid"):
        parse_safetensors(b"\xff" * 64, "x")


def _ev(v: str) -> VersionPublished:
    return VersionPublished(model="m", version=v, tp=2)


def test_version_index_order_is_publish_order() -> None:
    idx = VersionIndex()
    for seq, v in [(3, "a"), (7, "c"), (5, "b")]:
        idx.add(v, seq)
    assert idx.latest == "c" and idx.seq_of("b") == 5 and idx.seq_of("v0") == 0
    assert idx.is_newer("b", "a") and not idx.is_newer("b", "b")
    assert newest([(4, _ev("x")), (9, _ev("z")), (6, _ev("y"))])[1].version == "z"
    assert newest([]) is None


def test_durable_names_are_valid_and_distinct() -> None:
    a, b = durable_name("default", "Qwen2.5-0.5B"), durable_name("default", "Qwen2_5-0_5B")
    assert a != b
    for n in (a, b, durable_name("x y", "org/model*>")):
        assert not set(n) & set(". */\\>") and len(n) <= 80


def test_hf_named_state_passes_through_untransposed() -> None:
    hf = sharding.init_weights(CFG, seed=5)
    back = names.to_inference(hf, CFG)
    assert all(np.array_equal(back[k], hf[k]) for k in hf)
    assert back["lm_head.weight"].shape == (64, 16)


def test_mappings_take_an_hf_config_dict_or_path(tmp_path: Path) -> None:
    """As the README writes it: ``names.to_training(state, cfg)`` with ``cfg`` the dict of
    ``json.load(open("config.json"))`` (``publish(config=)`` takes one too). Before, only a
    ``ModelConfig`` worked: ``AttributeError: 'dict' object has no attribute ...``."""
    hf = dict(TINY_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    typed = ModelConfig.from_hf(hf)
    state = sharding.init_weights(typed, 2)
    want = names.to_training(state, typed)
    for cfg in (hf, tmp_path / "config.json", str(tmp_path)):
        got = names.to_training(state, cfg)
        assert list(got) == list(want)
        assert all(np.array_equal(got[k], want[k]) for k in want)
        back = names.to_inference(got, cfg)
        assert all(np.array_equal(back[k], state[k]) for k in state)
    assert names.get_name_mappings_to_inference(hf) == names.get_name_mappings_to_inference(typed)
