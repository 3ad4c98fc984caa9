"""Model config parsing: both RoPE layouts, every supported family's fields and
defaults, and one clear error naming the field for anything we cannot honour."""

from __future__ import annotations

from typing import Any

import pytest

from shared.model_config import ConfigError, ModelConfig, context_length

BASE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def parse(**extra: Any) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, **extra})


def test_rope_theta_from_either_layout() -> None:
    new = parse(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    old = parse(rope_theta=500000.0, rope_scaling=None)
    assert new.rope_theta == old.rope_theta == 500000.0
    assert new == old
    # rope_parameters without rope_theta keeps a top-level one
    assert parse(rope_theta=2e5, rope_parameters={"rope_type": "default"}).rope_theta == 2e5


def test_llama3_both_layouts() -> None:
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    new = parse(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **params})
    old = parse(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **params})
    assert new == old
    assert (new.rope_type, new.rope_factor, new.rope_original_max_position_embeddings) == (
        "llama3",
        8.0,
        8192,
    )


def test_linear_and_dynamic_context_length() -> None:
    lin = parse(rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=100)
    dyn = parse(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})
    assert (lin.rope_type, lin.max_model_len) == ("linear", 200)
    assert dyn.rope_type == "dynamic" and dyn.max_model_len == 4 * 2048
    raw = {**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}, "max_position_embeddings": 8}
    assert context_length(raw) == 16 and context_length(raw, 5) == 5


def test_families() -> None:
    q2 = parse(model_type="qwen2", tie_word_embeddings=True)
    assert q2.attention_bias and q2.tie_word_embeddings and not q2.qk_norm
    q3 = parse(model_type="qwen3", head_dim=16)
    assert q3.qk_norm and q3.head_dim == 16 and not q3.attention_bias
    assert parse(model_type="qwen3").head_dim == 128  # transformers' Qwen3 default
    e = parse(model_type="ernie4_5")
    assert e.rope_interleaved and e.tie_word_embeddings and e.rope_theta == 500000.0
    assert e.rms_norm_eps == 1e-5 and e.head_dim == 128
    llama = parse()
    assert llama.head_dim == 8 and llama.rope_theta == 10000.0 and not llama.tie_word_embeddings


def test_eos_ids_int_or_list() -> None:
    assert parse(eos_token_id=[128001, 128009]).eos_token_ids == (128001, 128009)
    cfg = parse(eos_token_id=7, bos_token_id=[1])
    assert (cfg.eos_token_id, cfg.eos_token_ids, cfg.bos_token_id) == (7, (7,), 1)
    assert parse().eos_token_ids == ()


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"model_type": "gemma"}, "model_type='gemma'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type='yarn'"),
        ({"rope_scaling": {"type": "dynamic"}}, "rope_scaling.factor"),
        ({"rope_parameters": {"rope_theta": 1e4, "mrope_section": [1]}}, "mrope_section"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, "per layer type"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
          "rope_scaling": {"type": "linear", "factor": 2.0}}, "contradict"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types[1]"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"head_dim": 7}, "head_dim"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)  # fmt: skip
def test_unsupported_names_the_field(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=r".*") as e:
        parse(**extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_head_dim_absent_is_the_family_default_null_is_hidden_over_heads() -> None:
    """As transformers' configs: Qwen3Config / Ernie4_5Config default to 128 when the
    field is absent; an explicit null (and llama, qwen2 always) is hidden / heads."""
    base = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
    for family, absent in (("llama", 16), ("qwen2", 16), ("qwen3", 128), ("ernie4_5", 128)):
        assert ModelConfig.from_hf({**base, "model_type": family}).head_dim == absent
        nulled = {**base, "model_type": family, "head_dim": None}
        assert ModelConfig.from_hf(nulled).head_dim == 16, family


def test_rms_norm_eps_zero_is_a_value() -> None:
    """0 is what the file says (transformers uses it); only an absent or null field
    takes the family default."""
    assert parse(rms_norm_eps=0.0).rms_norm_eps == 0.0
    assert parse(rms_norm_eps=None).rms_norm_eps == 1e-6
    assert parse(rms_norm_eps=1e-5).rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
        {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "attention_factor": 1.0},
        {"type": "su", "short_factor": [1.0]},
    ],
)
def test_an_unsupported_rope_type_is_named_before_its_keys(params: dict[str, Any]) -> None:
    """longrope / yarn configs carry keys only their type has: the error names the type
    (what the user must change), not the first of those keys."""
    for field in ("rope_parameters", "rope_scaling"):
        with pytest.raises(ConfigError) as e:
            parse(**{field: {"rope_theta": 1e4, **params}})
        kind = params.get("rope_type", params.get("type"))
        assert f"{field}." in str(e.value) and f"={kind!r}" in str(e.value), str(e.value)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_use_sliding_window_slides_only_from_max_window_layers(family: str) -> None:
    """As transformers derives ``layer_types`` when the file has none: layers from
    ``max_window_layers`` (default 28) on slide. None that far (or no ``sliding_window``)
    is full attention everywhere — served; a layer that slides is refused, named."""
    on = {"model_type": family, "use_sliding_window": True, "sliding_window": 8}
    for served in (
        {**on, "max_window_layers": 1},  # BASE has 1 layer
        {**on},  # default 28
        {**on, "sliding_window": None, "max_window_layers": 0},
        {**on, "max_window_layers": 0, "layer_types": ["full_attention"]},  # the file's word
    ):
        assert ModelConfig.from_hf({**BASE, **served}).model_type == family
    with pytest.raises(ConfigError, match="use_sliding_window=True.*max_window_layers=0"):
        ModelConfig.from_hf({**BASE, **on, "max_window_layers": 0})
    # an absent sliding_window is transformers' default 4096, not "none"
    absent = {k: v for k, v in on.items() if k != "sliding_window"}
    with pytest.raises(ConfigError, match="use_sliding_window=True"):
        ModelConfig.from_hf({**BASE, **absent, "max_window_layers": 0})
    with pytest.raises(ConfigError, match=r"layer_types\[0\]='sliding_attention'"):
        ModelConfig.from_hf({**BASE, **on, "layer_types": ["sliding_attention"]})
    # llama has no such derivation: the flag alone is refused
    with pytest.raises(ConfigError, match="use_sliding_window=True"):
        ModelConfig.from_hf({**BASE, "use_sliding_window": True})


def test_swish_is_silu() -> None:
    """transformers maps ``hidden_act`` "swish" to nn.SiLU: served; gelu is not."""
    assert parse(hidden_act="swish").model_type == "llama"
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        parse(hidden_act="gelu")


def test_llama_and_qwen3_biases() -> None:
    """transformers' llama / qwen3 ``attention_bias`` adds q/k/v *and* o_proj biases,
    llama's ``mlp_bias`` gate/up/down ones, ernie4_5's ``use_bias`` all of them; qwen2
    has q/k/v biases only."""
    llama = parse(attention_bias=True, mlp_bias=True)
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    q3 = parse(model_type="qwen3", attention_bias=True)
    assert q3.attention_bias and q3.o_proj_bias and not q3.mlp_bias
    q2 = parse(model_type="qwen2", attention_bias=False)  # Qwen2Config has no such field
    assert q2.attention_bias and not q2.o_proj_bias and not q2.mlp_bias
    e = parse(model_type="ernie4_5", use_bias=True)
    assert e.attention_bias and e.o_proj_bias and e.mlp_bias
    # a field the family does not read is ignored, as transformers does (Qwen3MLP has none)
    assert not parse(model_type="qwen3", mlp_bias=True).mlp_bias
    plain = parse(attention_bias=False, mlp_bias=False)
    assert not (plain.attention_bias or plain.o_proj_bias or plain.mlp_bias)


def test_num_key_value_heads_absent_is_the_family_default_null_is_heads() -> None:
    """As transformers' configs: an absent field takes the class default (Qwen2Config's
    and Qwen3Config's 32, Ernie4_5Config's 2, llama's = num_attention_heads), an explicit
    null is num_attention_heads. A qwen2 config of 4 heads without the field is refused
    (transformers would build 32 kv heads for 4 query heads), not served as MHA."""
    base = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf({**base, "model_type": "llama"}).num_key_value_heads == 4
    assert ModelConfig.from_hf({**base, "model_type": "ernie4_5"}).num_key_value_heads == 2
    wide = {**base, "num_attention_heads": 32, "hidden_size": 64}
    for family in ("qwen2", "qwen3"):
        with pytest.raises(ConfigError, match="num_key_value_heads"):
            ModelConfig.from_hf({**base, "model_type": family})
        assert ModelConfig.from_hf({**wide, "model_type": family}).num_key_value_heads == 32
    for family in ("llama", "qwen2", "qwen3", "ernie4_5"):
        nulled = {**base, "model_type": family, "num_key_value_heads": None}
        assert ModelConfig.from_hf(nulled).num_key_value_heads == 4, family
