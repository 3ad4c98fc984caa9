"""The tensors of a model and how tensor parallelism splits them. Pure (numpy, no paddle).

The one definition of a served model's tensor spec (HF names and unsharded shapes, from
:class:`shared.model_config.ModelConfig`) and of the sharding rules over ``tp`` ranks
(Megatron style), used by the worker (which slices what it loads), the trainer (which
shards what it publishes) and the tiny model:

- column-parallel (dim 0 split): q/k/v/gate/up weights and biases, so each
  rank owns whole attention heads and a slice of the MLP (``intermediate_size`` need
  not divide by ``tp``: the first ``intermediate_size % tp`` ranks hold one more
  column); with fewer kv heads than ranks, each rank holds a copy of the one kv head
  its query heads read;
- row-parallel (dim 1 split): o_proj and down_proj weights (their biases replicated:
  added once, after the all-reduce);
- replicated: the norms (qwen3's per-head q/k norms too), ``embed_tokens`` and
  ``lm_head``.
"""

from __future__ import annotations

import numpy as np

from shared.model_config import ModelConfig

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")  # split along intermediate_size
_REPLICATED = (
    "input_layernorm",
    "post_attention_layernorm",
    "norm",
    "embed_tokens",
    "lm_head",
    "q_norm",
    "k_norm",
)


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Unsharded HF shape of every parameter the model needs, in a stable order."""
    d, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{proj}.weight"] = (out, d)
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (out,)
        if cfg.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[f"{p}self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[f"{p}self_attn.o_proj.weight"] = (d, q)
        if cfg.o_proj_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (d,)
        shapes[f"{p}mlp.gate_proj.weight"] = (cfg.intermediate_size, d)
        shapes[f"{p}mlp.up_proj.weight"] = (cfg.intermediate_size, d)
        shapes[f"{p}mlp.down_proj.weight"] = (d, cfg.intermediate_size)
        if cfg.mlp_bias:
            shapes[f"{p}mlp.gate_proj.bias"] = (cfg.intermediate_size,)
            shapes[f"{p}mlp.up_proj.bias"] = (cfg.intermediate_size,)
            shapes[f"{p}mlp.down_proj.bias"] = (d,)
        shapes[f"{p}input_layernorm.weight"] = (d,)
        shapes[f"{p}post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def shard_names(cfg: ModelConfig) -> list[str]:
    return list(full_shapes(cfg))


def split_axis(name: str) -> int | None:
    """The axis `name` is split along under TP, or None when it is replicated."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _COLUMN:
        return 0
    if module in _ROW:  # a row-parallel bias is whole on every rank, added once after
        return 1 if parts[-1] == "weight" else None  # the all-reduce
    if module in _REPLICATED:
        return None
    raise ValueError(f"unknown parameter {name!r}")


def axis_part(cfg: ModelConfig, name: str, length: int, rank: int, tp: int) -> tuple[int, int]:
    """(start, size) of `rank`'s part of a split axis of `length`. With fewer kv heads
    than ranks (tp a multiple of num_key_value_heads), k/v are replicated per kv head:
    rank r holds the kv head its query heads read, ``r // (tp / kv_heads)``."""
    kv = cfg.num_key_value_heads
    if kv < tp and name.split(".")[-2] in ("k_proj", "v_proj"):
        if length % kv:
            raise ValueError(f"{name}: axis of {length} cannot hold {kv} kv heads")
        size = length // kv
        return (rank // (tp // kv)) * size, size
    if name.split(".")[-2] in _MLP and length >= tp:
        # the MLP's columns need not divide evenly (many of transformers' model testers
        # use intermediate_size 37): the first ``length % tp`` ranks hold one more
        base, extra = divmod(length, tp)
        return rank * base + min(rank, extra), base + (rank < extra)
    if length % tp:
        raise ValueError(f"{name}: axis of {length} cannot be split {tp} ways")
    return rank * (length // tp), length // tp


def shard_shape(
    cfg: ModelConfig, name: str, full_shape: tuple[int, ...], rank: int, tp: int
) -> tuple[int, ...]:
    cfg.validate_tp(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} out of range for tp={tp}")
    axis = split_axis(name)
    if axis is None:
        return tuple(full_shape)
    if axis >= len(full_shape):
        raise ValueError(f"{name}: shape {tuple(full_shape)} cannot be split {tp} ways")
    shape = list(full_shape)
    shape[axis] = axis_part(cfg, name, full_shape[axis], rank, tp)[1]
    return tuple(shape)


def shard_part(
    cfg: ModelConfig, name: str, shape: tuple[int, ...], rank: int, tp: int
) -> tuple[int, int, int] | None:
    """``(axis, start, size)`` of `rank`'s part of tensor `name` of full `shape` (None:
    replicated): the part :func:`shard_view` takes, for readers that fetch only it."""
    shard_shape(cfg, name, shape, rank, tp)  # validates
    axis = split_axis(name)
    if axis is None:
        return None
    start, size = axis_part(cfg, name, shape[axis], rank, tp)
    return axis, start, size


def shard_view(cfg: ModelConfig, name: str, full: np.ndarray, rank: int, tp: int) -> np.ndarray:
    """`rank`'s part of the full tensor `full`, as a view (no copy)."""
    shard_shape(cfg, name, full.shape, rank, tp)  # validates
    axis = split_axis(name)
    if axis is None:
        return full
    start, size = axis_part(cfg, name, full.shape[axis], rank, tp)
    index: list[slice] = [slice(None)] * full.ndim
    index[axis] = slice(start, start + size)
    return full[tuple(index)]


def shard_tensor(cfg: ModelConfig, name: str, full: np.ndarray, rank: int, tp: int) -> np.ndarray:
    """`rank`'s part of the full tensor `full`, contiguous (a copy when it is a slice)."""
    return np.ascontiguousarray(shard_view(cfg, name, full, rank, tp))


def local_kv_heads(cfg: ModelConfig, tp: int) -> int:
    """kv heads per rank: a 1/tp share, or 1 (replicated) when there are fewer than tp."""
    return max(1, cfg.num_key_value_heads // tp)


def init_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Deterministic random float32 weights of the full spec (the tiny model, tests)."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in full_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return weights
