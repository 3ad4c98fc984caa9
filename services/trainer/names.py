"""Training names ↔ inference names: the one place that defines the mapping. Pure.

The rollout side (worker ranks, object-store shards, ``state_dict`` of a rank) uses HF
names and HF layout; a paddle/PaddleNLP trainer uses its own names, and paddle's
``nn.Linear`` stores its weight as ``[in, out]`` — the transpose of HF's ``[out, in]``.

=============================================  ============================================
inference (HF) name                            training (PaddleNLP-style) name
=============================================  ============================================
``model.embed_tokens.weight``                  ``<p>.embed_tokens.weight``
``model.layers.{i}.self_attn.{q,k,v}_proj.*``  ``<p>.layers.{i}.self_attn.{q,k,v}_proj.*``
``model.layers.{i}.self_attn.o_proj.weight``   ``<p>.layers.{i}.self_attn.o_proj.weight``
``model.layers.{i}.mlp.{gate,up,down}_proj.*`` ``<p>.layers.{i}.mlp.{gate,up,down}_proj.*``
``model.layers.{i}.*_layernorm.weight``        ``<p>.layers.{i}.*_layernorm.weight``
``model.norm.weight``                          ``<p>.norm.weight``
``lm_head.weight``                             ``lm_head.weight``
=============================================  ============================================

``<p>`` is the architecture prefix: ``llama`` or ``qwen2``. **Transposed** between the
two sides: every 2-D ``*_proj.weight`` and ``lm_head.weight`` (paddle keeps both as
``[in, out]``); embeddings, norms and biases are not (:func:`is_transposed`).

``get_name_mappings_to_training(cfg)`` gives inference → training (FastDeploy's name);
``get_name_mappings_to_inference(cfg)`` is its inverse. :func:`to_inference` and
:func:`to_training` apply names *and* transposes to a state dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shared.model_config import ModelConfig, read_hf_config
from shared.sharding import full_shapes

PREFIXES = ("llama", "qwen2")
# what every function here takes as ``cfg``: as ``publish(config=)`` does
Config = ModelConfig | Mapping[str, Any] | str | Path


def load_config(config: Config) -> ModelConfig:
    """A :class:`ModelConfig` from itself, an HF config dict, or a ``config.json`` path
    (or a model dir): the README's ``names.to_training(state, cfg)`` with the dict of
    ``json.load(open("config.json"))`` must work, not fail on ``dict.attention_bias``."""
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, str | Path):
        config = read_hf_config(Path(config))
    if not isinstance(config, Mapping):
        raise TypeError("config must be a ModelConfig, an HF config dict or a config.json path")
    return ModelConfig.from_hf(dict(config))


def default_prefix(cfg: ModelConfig) -> str:
    # q/k/v biases without an o_proj one: qwen2 (llama's attention_bias has both)
    return "qwen2" if cfg.attention_bias and not cfg.o_proj_bias else "llama"


def is_transposed(inference_name: str) -> bool:
    """True for the Linear weights paddle stores as ``[in, out]``."""
    return inference_name == "lm_head.weight" or (
        inference_name.endswith("_proj.weight") and ".layers." in inference_name
    )


def training_name(inference_name: str, prefix: str = "llama") -> str:
    if prefix not in PREFIXES:
        raise ValueError(f"unknown training prefix {prefix!r} (one of {PREFIXES})")
    if inference_name.startswith("model."):
        return prefix + inference_name[len("model") :]
    if inference_name == "lm_head.weight":
        return inference_name
    raise ValueError(f"no training name for {inference_name!r}")


def get_name_mappings_to_training(cfg: Config, prefix: str | None = None) -> dict[str, str]:
    """Inference (HF) name → training name, for every parameter of ``cfg``."""
    cfg = load_config(cfg)
    p = prefix or default_prefix(cfg)
    return {name: training_name(name, p) for name in full_shapes(cfg)}


def get_name_mappings_to_inference(cfg: Config, prefix: str | None = None) -> dict[str, str]:
    """Training name → inference (HF) name: the inverse of the above."""
    return {t: i for i, t in get_name_mappings_to_training(cfg, prefix).items()}


def to_numpy(t: Any) -> np.ndarray:
    """A paddle tensor or array-like as numpy; floating tensors as float32 (the rollout
    dtype; paddle's bfloat16 has no numpy type)."""
    if hasattr(t, "numpy") and not isinstance(t, np.ndarray):
        if "float" in str(getattr(t, "dtype", "")) and "float32" not in str(t.dtype):
            t = t.astype("float32")
        t = t.numpy()
    a = np.asarray(t)
    if a.dtype.kind == "f" and a.dtype != np.float32:
        a = a.astype(np.float32)
    return a


def detect_prefix(names: Mapping[str, Any]) -> str | None:
    for p in PREFIXES:
        if any(n.startswith(p + ".") for n in names):
            return p
    return None


def to_inference(
    state: Mapping[str, Any],
    cfg: Config,
    prefix: str | None = None,
    *,
    contiguous: bool = True,
) -> dict[str, np.ndarray]:
    """A training-named state dict (paddle or numpy) as HF-named, HF-layout numpy arrays.

    ``contiguous=False`` leaves transposed weights as transposed views (no copy): the
    publisher copies each byte once, straight into the shard it uploads.

    Raises ``ValueError`` naming unknown or missing tensors. A dict with no
    ``llama.``/``qwen2.`` name is taken as HF-named and HF-layout and passes through.
    """
    cfg = load_config(cfg)
    p = prefix or detect_prefix(state)
    if p is None:
        # no training-prefixed name: an HF-named state dict (``lm_head.weight`` alone
        # cannot tell the layouts apart, so the prefix decides)
        unknown = sorted(set(state) - set(full_shapes(cfg)))
        if unknown:
            raise ValueError(f"unknown tensors (no inference name): {unknown[:5]}")
        return {k: to_numpy(v) for k, v in state.items()}
    to_inf = get_name_mappings_to_inference(cfg, p)
    wanted = set(to_inf.values())
    out: dict[str, np.ndarray] = {}
    unknown = []
    for name, t in state.items():
        if name in to_inf:
            inf = to_inf[name]
            a = to_numpy(t)
            if is_transposed(inf) and a.ndim == 2:
                a = np.ascontiguousarray(a.T) if contiguous else a.T
            out[inf] = a
        elif name in wanted:
            out[name] = to_numpy(t)
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"unknown tensors (no inference name): {sorted(unknown)[:5]}")
    missing = sorted(wanted - set(out))
    if missing:
        raise ValueError(f"state dict lacks {[training_name(n, p) for n in missing[:5]]}")
    return out


def to_training(
    state: Mapping[str, np.ndarray], cfg: Config, prefix: str | None = None
) -> dict[str, np.ndarray]:
    """The inverse of :func:`to_inference`: HF names/layout → training names/layout."""
    to_train = get_name_mappings_to_training(cfg, prefix)
    out = {}
    for name, a in state.items():
        if name not in to_train:
            raise ValueError(f"unknown inference tensor {name!r}")
        arr = np.asarray(a)
        out[to_train[name]] = (
            np.ascontiguousarray(arr.T) if is_transposed(name) and arr.ndim == 2 else arr
        )
    return out
