"""A small Llama written with ``paddle.nn``: the training side of the example (and of the
rollout-state test). Parameter names are PaddleNLP's (``llama.layers.0.self_attn.q_proj
.weight``, ``lm_head.weight``) and ``nn.Linear`` keeps ``[in, out]``, so its
``state_dict()`` is exactly what :mod:`services.trainer.names` maps to the served (HF)
layout. The architecture is the one rollbus serves for ``model_type: llama``: RMSNorm,
RoPE (rotate-half, ``rope_theta``), grouped-query attention, SiLU-gated MLP, untied
``lm_head``.

Full-sequence forward only (no KV cache): training recomputes whole sequences, and
:meth:`LlamaForCausalLM.greedy` decodes by recomputing — slow, but it is the reference.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F


def llama_config(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 64,
    bos: int | None = None,
    eos: int | None = None,
) -> dict[str, Any]:
    """An HF ``config.json`` (``model_type: llama``) that rollbus serves."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if bos is not None:
        cfg["bos_token_id"] = bos
    if eos is not None:
        cfg["eos_token_id"] = eos
    return cfg


class RMSNorm(nn.Layer):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([d], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        var = (x * x).mean(-1, keepdim=True)
        return x * paddle.rsqrt(var + self.eps) * self.weight


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias_attr=False)


class Attention(nn.Layer):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        d = c["hidden_size"]
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = d // self.heads
        self.q_proj = _linear(d, self.heads * self.head_dim)
        self.k_proj = _linear(d, self.kv_heads * self.head_dim)
        self.v_proj = _linear(d, self.kv_heads * self.head_dim)
        self.o_proj = _linear(self.heads * self.head_dim, d)

    def forward(
        self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mask: paddle.Tensor
    ) -> paddle.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).reshape([b, t, self.heads, hd]).transpose([0, 2, 1, 3])
        k = self.k_proj(x).reshape([b, t, self.kv_heads, hd]).transpose([0, 2, 1, 3])
        v = self.v_proj(x).reshape([b, t, self.kv_heads, hd]).transpose([0, 2, 1, 3])
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = paddle.repeat_interleave(k, rep, axis=1)
            v = paddle.repeat_interleave(v, rep, axis=1)
        att = paddle.matmul(q, k, transpose_y=True) / math.sqrt(hd) + mask
        out = paddle.matmul(F.softmax(att, axis=-1), v)
        return self.o_proj(out.transpose([0, 2, 1, 3]).reshape([b, t, self.heads * hd]))


def _rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    rot = paddle.concat([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


class MLP(nn.Layer):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        d, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj, self.up_proj, self.down_proj = _linear(d, i), _linear(d, i), _linear(i, d)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Layer):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        eps = c.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps)

    def forward(self, x: paddle.Tensor, cos: Any, sin: Any, mask: Any) -> paddle.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Layer):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.LayerList([DecoderLayer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c.get("rms_norm_eps", 1e-6))


class LlamaForCausalLM(nn.Layer):
    """``forward(ids [B, T]) -> logits [B, T, vocab]`` (causal; right padding is fine:
    a position never attends to later ones)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        self.llama = LlamaModel(self.config)
        self.lm_head = _linear(self.config["hidden_size"], self.config["vocab_size"])
        hd = self.config["hidden_size"] // self.config["num_attention_heads"]
        theta = float(self.config.get("rope_theta", 10000.0))
        self._inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)

    def _tables(self, t: int) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        freqs = np.outer(np.arange(t, dtype=np.float64), self._inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos = paddle.to_tensor(np.cos(emb).astype(np.float32))
        sin = paddle.to_tensor(np.sin(emb).astype(np.float32))
        mask = np.triu(np.full((t, t), -1e9, dtype=np.float32), k=1)
        return cos, sin, paddle.to_tensor(mask)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        cos, sin, mask = self._tables(int(ids.shape[1]))
        x = self.llama.embed_tokens(ids)
        for layer in self.llama.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.llama.norm(x))

    def init_weights(self, seed: int, std: float = 0.02, head_std: float | None = None) -> None:
        """Deterministic normal(0, ``std``) weights (norms 1); ``head_std`` for
        ``lm_head`` (a larger one gives clear greedy margins)."""
        rng = np.random.default_rng(seed)
        state = {}
        for name, p in self.state_dict().items():
            if name.endswith("norm.weight"):
                a = np.ones(p.shape, np.float32)
            else:
                s = head_std if (head_std is not None and name == "lm_head.weight") else std
                a = (rng.standard_normal(p.shape) * s).astype(np.float32)
            state[name] = a
        self.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})

    @paddle.no_grad()
    def greedy(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and their logprobs (temperature 1), recomputing each step."""
        ids, out, lps = list(prompt), [], []
        for _ in range(max_tokens):
            logits = self(paddle.to_tensor([ids], dtype="int64"))[0, -1].astype("float64")
            lp = F.log_softmax(logits, axis=-1).numpy()
            tok = int(np.argmax(lp))
            out.append(tok)
            lps.append(float(lp[tok]))
            ids.append(tok)
        return out, lps


def write_model_dir(path: Path, model: LlamaForCausalLM, version: str = "v0") -> Path:
    """An HF model dir rollbus serves: ``config.json``, ``model.safetensors`` (the
    model's weights mapped to inference names/layout), ``version.txt``."""
    from safetensors.numpy import save_file

    from services.trainer import names
    from shared.model_config import ModelConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(model.config)
    state = names.to_inference(model.state_dict(), cfg)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config, indent=2))
    (path / "version.txt").write_text(version + "\n")
    return path
