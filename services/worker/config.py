"""The model config rollbus serves (HF ``config.json``), with no paddle import: the
launcher checks a model dir with it before any rank starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_HF_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # qwen2-style bias on q/k/v only
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type {model_type!r} is not supported (llama, qwen2)")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (silu)")
        scaling = config.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"rope_scaling {scaling!r} is not supported")
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window is not supported")
        if model_type == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
            # HF llama's attention_bias also adds an o_proj bias, which we do not model.
            raise ValueError("llama attention_bias/mlp_bias is not supported")
        missing = [k for k in _HF_REQUIRED if k not in config]
        if missing:
            raise ValueError(f"config lacks {', '.join(missing)}")
        sizes = {k: int(config[k]) for k in _HF_REQUIRED}
        heads = sizes["num_attention_heads"]
        if config.get("head_dim", sizes["hidden_size"] // heads) * heads != sizes["hidden_size"]:
            raise ValueError("head_dim != hidden_size / num_attention_heads is not supported")
        return cls(
            **sizes,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            attention_bias=model_type == "qwen2",
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=_first(config.get("bos_token_id")),
            eos_token_id=_first(config.get("eos_token_id")),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate_tp(self, tp: int) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) % tp:
                raise ValueError(f"{name}={getattr(self, name)} is not divisible by tp={tp}")


def _first(value: int | list[int] | None) -> int | None:
    # HF configs may list several eos ids; the first is the canonical one.
    if isinstance(value, list):
        return value[0] if value else None
    return value
