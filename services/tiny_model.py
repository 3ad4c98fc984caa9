"""The default model: a tiny HF-Llama-format dir created on first run.

``config.json`` (``model_type: llama``), ``model.safetensors`` with HF parameter names
(deterministic from the seed), ``version.txt`` = ``v0``. The byte-level tokenizer needs
no ``tokenizer.json``. ``create_model_dir`` also makes bigger models for tests and
benchmarks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from shared.model_config import ModelConfig, read_hf_config
from shared.sharding import init_weights

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}


def create_model_dir(
    path: Path, config: dict[str, Any] | None = None, seed: int = 0, version: str = "v0"
) -> Path:
    """Write a full model dir atomically (a half-written dir is never picked up)."""
    cfg_dict = {**TINY_CONFIG, **(config or {})}
    cfg = ModelConfig.from_hf(cfg_dict)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(init_weights(cfg, seed), str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    (tmp / "version.txt").write_text(version + "\n")
    tmp.rename(path)
    return path


def ensure_tiny_model(path: Path, seed: int = 0) -> Path:
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return create_model_dir(path, seed=seed)


def write_version(model_dir: Path, version: str, seed: int) -> Path:
    """A snapshot version ``<model>/versions/<version>/`` with new deterministic weights."""
    cfg_dict = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(cfg_dict)
    d = model_dir / "versions" / version
    d.mkdir(parents=True, exist_ok=True)
    save_file(init_weights(cfg, seed), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    return d
