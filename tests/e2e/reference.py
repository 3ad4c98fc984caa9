"""In-process greedy reference: the same weights, tp=1, no bus — what the stack must say."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paddle
from safetensors.numpy import load_file

from services.worker import model as mdl
from shared.model_config import ModelConfig


def load_weights(weights_dir: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(weights_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def greedy(
    model_dir: Path,
    prompt: list[int],
    n: int,
    weights_dir: Path | None = None,
    stop: int | None = None,
    weights: dict[str, np.ndarray] | None = None,
    process: Callable[[np.ndarray, list[int]], np.ndarray] | None = None,
) -> list[int]:
    """Greedy tokens for ``prompt`` with the HF-named weights of ``weights`` (a dict),
    ``weights_dir`` or the model dir itself; ``process(logits, output so far)``: the
    logits the argmax is taken of (e.g. penalised)."""
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    host = weights if weights is not None else load_weights(weights_dir or model_dir)
    w = {k: paddle.to_tensor(v) for k, v in host.items()}
    bs = 16
    need = -(-(len(prompt) + n) // bs)
    kv = mdl.KVCache(cfg, need, bs, 1)
    model = mdl.TPModel(cfg, 0, 1)
    table = list(range(need))
    tokens = list(prompt)
    out: list[int] = []
    pos = 0
    new = list(prompt)
    for _ in range(n):
        logits = model.forward(w, kv, mdl.Batch([new], [pos], [table])).numpy()[0]
        if process is not None:
            logits = process(logits, out)
        tok = int(np.argmax(logits))
        pos += len(new)
        out.append(tok)
        tokens.append(tok)
        if tok == stop:
            break
        new = [tok]
    return out
