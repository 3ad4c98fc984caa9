"""rollbus's worker model equals transformers on every family and RoPE variant, at TP=1
(in process) and TP=2 (two real gloo ranks): the same greedy tokens, and every step's
log-probabilities within 2e-3 (fp32 checkpoint) / 2e-2 (bf16, fp16)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rollbus_side
from cases import BY_NAME, CASES, NEW_TOKENS, PROMPTS

from shared.model_config import ModelConfig
from shared.safetensors import read_header

IDS = [c.name for c in CASES]


def assert_same(name: str, got: dict[str, Any], ref: dict[str, Any]) -> None:
    tol = BY_NAME[name].tolerance
    assert list(got["tokens"]) == ref["tokens"], f"{name}: greedy tokens differ"
    diff = np.abs(np.asarray(got["logprobs"]) - ref["logprobs"]).max()
    assert diff < tol, f"{name}: chosen-token logprob differs by {diff:.2e}"
    full = np.abs(got["log_softmax"] - ref["log_softmax"]).max()
    assert full < tol, f"{name}: log_softmax differs by {full:.2e}"


@pytest.mark.parametrize("name", IDS)
def test_tp1_equals_transformers(
    name: str, model_dirs: dict[str, Path], references: dict[tuple[str, int], Any]
) -> None:
    for i, prompt in enumerate(PROMPTS):
        got = rollbus_side.greedy(model_dirs[name], prompt, NEW_TOKENS)
        assert_same(name, got, references[(name, i)])


@pytest.mark.parametrize("name", IDS)
def test_tp2_equals_transformers(
    name: str,
    references: dict[tuple[str, int], Any],
    tp2_results: dict[tuple[str, int], list[dict[str, Any]]],
) -> None:
    for i in range(len(PROMPTS)):
        for rank_result in tp2_results[(name, i)]:
            assert_same(name, rank_result, references[(name, i)])


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_chunked_prefill_equals_transformers(
    name: str, model_dirs: dict[str, Path], references: dict[tuple[str, int], Any]
) -> None:
    got = rollbus_side.greedy(model_dirs[name], PROMPTS[0], NEW_TOKENS, chunk=4)
    assert_same(name, got, references[(name, 0)])


def test_configs_are_in_the_layout_they_claim(model_dirs: dict[str, Path]) -> None:
    """The suite really covers both layouts and parses each to the intended RoPE."""
    for case in CASES:
        raw = json.loads((model_dirs[case.name] / "config.json").read_text())
        if case.layout == "new":
            assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == case.theta
        else:
            assert "rope_parameters" not in raw and raw["rope_theta"] == case.theta
        files = sorted(model_dirs[case.name].glob("*.safetensors"))
        if case.max_shard_size:
            assert len(files) > 1
            assert (model_dirs[case.name] / "model.safetensors.index.json").is_file()
        stored = {e.dtype for f in files for e in read_header(f).tensors.values()}
        assert stored == {{"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[case.dtype]}
        cfg = ModelConfig.from_hf(raw)
        assert cfg.rope_theta == case.theta
        assert cfg.rope_type == case.rope.get("rope_type", "default")
        assert cfg.model_type == case.family


def test_config_json_variants_equal_transformers(
    model_dirs: dict[str, Path], references: dict[tuple[str, int], Any], tmp_path: Path
) -> None:
    """What config.json files in the wild carry, on the llama case (transformers reads
    each the same way): unknown fields, ``torch_dtype`` (transformers 4) instead of
    ``dtype``, no ``tie_word_embeddings`` / ``head_dim`` (their defaults), a null
    ``rope_scaling`` beside ``rope_parameters``, ``rope_theta`` as an int."""
    import shutil

    d = tmp_path / "llama"
    shutil.copytree(model_dirs["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    for key in ("tie_word_embeddings", "head_dim"):
        del cfg[key]
    cfg["rope_parameters"]["rope_theta"] = int(cfg["rope_parameters"]["rope_theta"])
    cfg.update(rope_scaling=None, some_future_field={"x": [1, 2]}, use_cache=True)
    (d / "config.json").write_text(json.dumps(cfg))
    for i, prompt in enumerate(PROMPTS):
        assert_same("llama", rollbus_side.greedy(d, prompt, NEW_TOKENS), references[("llama", i)])
