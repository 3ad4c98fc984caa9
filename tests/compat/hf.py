"""Random-weight models built with transformers' own classes, and transformers' answers.

``build(case, dir)`` writes a HF model dir with ``save_pretrained`` (safetensors, the
case's dtype) and rewrites ``config.json`` into the case's layout: ``new`` is what
transformers 5 writes (``rope_parameters`` holding ``rope_theta``), ``old`` is the
transformers 4 layout (top-level ``rope_theta`` plus ``rope_scaling``, no ``layer_types``).

Weights: transformers' init with ``initializer_range`` 0.02 gives logits so flat that
greedy decoding meets near-ties; embeddings and ``lm_head`` are scaled up so the top two
logits of every step stay well apart (``reference`` asserts the margin), which makes
"greedy tokens identical" a meaningful, stable check.

This file imports torch and transformers; only ``tests/compat`` uses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf

SIZES = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MIN_MARGIN = 0.01  # top-1 minus top-2 logit at every reference step


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # llama, qwen2, qwen3, ernie4_5
    layout: str = "new"  # new: rope_parameters; old: rope_theta + rope_scaling
    dtype: str = "float32"  # checkpoint dtype: float32, bfloat16, float16
    rope: dict[str, Any] = field(default_factory=dict)  # rope_type and its parameters
    theta: float = 500000.0
    extra: dict[str, Any] = field(default_factory=dict)  # more config fields
    max_shard_size: str | None = None  # e.g. "100KB": a sharded checkpoint with an index
    seed: int = 0

    @property
    def tolerance(self) -> float:
        return 2e-3 if self.dtype == "float32" else 2e-2


CLASSES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
}
if hasattr(tf, "Ernie4_5ForCausalLM"):
    CLASSES["ernie4_5"] = (tf.Ernie4_5Config, tf.Ernie4_5ForCausalLM)


def build(case: Case, out: Path, prompts: list[list[int]], new_tokens: int) -> Path:
    """Create the model dir for ``case`` under ``out`` (once) and return it: the first
    seed from ``case.seed`` on whose greedy continuations of ``prompts`` transformers
    meets no near-tie."""
    if (out / "config.json").is_file():
        return out
    for seed in range(case.seed, case.seed + 20):
        _write(case, out, seed)
        try:
            for prompt in prompts:
                reference(out, prompt, new_tokens)
            return out
        except NearTie:
            continue
    raise RuntimeError(f"{case.name}: no seed without near-ties")


class NearTie(AssertionError):
    pass


def _write(case: Case, out: Path, seed: int) -> None:
    config_cls, model_cls = CLASSES[case.family]
    rope = {"rope_type": "default", **case.rope, "rope_theta": case.theta}
    config = config_cls(
        **{**SIZES, **case.extra},
        rope_parameters=rope,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        if not config.tie_word_embeddings:
            model.lm_head.weight.normal_(0.0, 0.5)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones: a norm left out shows
                p.uniform_(0.5, 1.5)
            elif "layers." in name:
                p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, case.dtype))
    if case.max_shard_size:
        model.save_pretrained(out, safe_serialization=True, max_shard_size=case.max_shard_size)
    else:
        model.save_pretrained(out, safe_serialization=True)
    _relayout(out / "config.json", case.layout)


def _relayout(path: Path, layout: str) -> None:
    cfg = json.loads(path.read_text())
    params = cfg.get("rope_parameters")
    assert isinstance(params, dict) and "rope_theta" in params, cfg
    if layout == "old":
        params = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = None if params.get("rope_type") == "default" else params
        # older transformers wrote no layer_types: qwen2 / qwen3 derive them from
        # use_sliding_window, sliding_window and max_window_layers
        cfg.pop("layer_types", None)
    else:
        assert layout == "new", layout
        cfg.pop("rope_theta", None)
        cfg.pop("rope_scaling", None)
    path.write_text(json.dumps(cfg, indent=2))


def load(model_dir: Path) -> Any:
    """The model as transformers loads the dir, computing in float32."""
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def reference(
    model_dir: Path, prompt: list[int], new_tokens: int, repetition_penalty: float | None = None
) -> dict[str, Any]:
    """transformers' greedy ``generate``: tokens (stopping where it stops on an eos id)
    and the logprob of each chosen token (``log_softmax`` of that step's logits — with a
    ``repetition_penalty``, of the logits its processor left, the ones argmax took)."""
    model = load(model_dir)
    ids = torch.tensor([prompt])
    extra = {} if repetition_penalty is None else {"repetition_penalty": repetition_penalty}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **extra,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    steps = out.logits if repetition_penalty is None else out.scores
    logp = np.stack([torch.log_softmax(x[0].double(), -1).numpy() for x in steps])
    top2 = np.sort(logp, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    if margin < MIN_MARGIN:
        raise NearTie(f"near-tie in the reference (margin {margin:.4f})")
    return {
        "tokens": tokens,
        "logprobs": logp[np.arange(len(tokens)), tokens],
        "log_softmax": logp,  # [steps, vocab]
    }


def full_logits(model_dir: Path, sequence: list[int]) -> np.ndarray:
    """transformers' logits [len(sequence), vocab] over a whole sequence in one forward."""
    model = load(model_dir)
    with torch.no_grad():
        return np.asarray(model(torch.tensor([sequence])).logits[0].double().numpy())
