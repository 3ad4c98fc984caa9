"""``config.json`` read as transformers reads it: for configs transformers accepts, the
RoPE and size fields rollbus serves with (``shared/model_config.py``) equal the ones
transformers' model derives (its ``rope_parameters`` as the rotary embedding
standardizes them), or rollbus refuses the config (never a silent other value).

Cheap (no model, no stack): every variant is a dict given to both parsers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import transformers as tf
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from shared.model_config import ModelConfig

BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama3": {"rope_parameters": LLAMA3},
    # a top-level original_max_position_embeddings (Phi-3's layout) wins over the one in
    # rope_parameters in transformers 5: rollbus served the other one, silently
    "llama3-top-level-original-max": {
        "rope_parameters": LLAMA3,
        "original_max_position_embeddings": 16,
    },
    "llama3-no-original-max": {
        "rope_parameters": {k: v for k, v in LLAMA3.items() if "original" not in k}
    },
    "theta-top-level-only": {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0},
        "rope_theta": 12345.0,
    },
    "no-theta": {"rope_parameters": {"rope_type": "default"}},
    "old-type-key": {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e4},
    "rope-parameters-null": {"rope_parameters": None, "rope_theta": 5e5},
    "head-dim-null": {"head_dim": None},
}


def _transformers(cfg: dict[str, Any]) -> dict[str, Any]:
    c = tf.LlamaConfig.from_dict(copy.deepcopy(cfg))
    # the model's rotary embedding standardizes rope_parameters again when it computes
    # its frequencies (a top-level original_max_position_embeddings lands there only
    # then): read them after building it, as the model uses them
    LlamaRotaryEmbedding(c)
    rp = c.rope_parameters
    kind = rp["rope_type"]
    return {
        "rope_type": kind,
        "rope_theta": float(rp["rope_theta"]),
        "rope_factor": float(rp.get("factor", 1.0)),
        "original_max": rp.get("original_max_position_embeddings") if kind == "llama3" else None,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    }


def _rollbus(cfg: dict[str, Any]) -> dict[str, Any]:
    c = ModelConfig.from_hf(copy.deepcopy(cfg))
    return {
        "rope_type": c.rope_type,
        "rope_theta": c.rope_theta,
        "rope_factor": c.rope_factor,
        "original_max": c.rope_original_max_position_embeddings
        if c.rope_type == "llama3"
        else None,
        "head_dim": c.head_dim,
    }


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_fields_equal_transformers(name: str) -> None:
    cfg = {**BASE, **VARIANTS[name]}
    assert _rollbus(cfg) == _transformers(cfg), name
