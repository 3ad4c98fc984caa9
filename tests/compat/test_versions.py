"""Versions of a transformers checkpoint through a real TP=2 stack, as an RL run uses them:
the qwen2-bf16 case (tied embeddings — ``save_pretrained`` writes no ``lm_head`` —, q/k/v
bias, bf16 safetensors) is served; a trainer writes the next versions with
``save_pretrained`` in bf16 (one sharded with an index) and publishes them with ``rollbus
publish DIR`` (object store) and ``rollbus publish --ipc`` in a process that refuses to
import paddle; after ``update_weights`` rollbus generates what transformers generates
with those weights, and ``rollout_state_dict()`` returns exactly the checkpoint's tensors
by their HF names, gathered from both ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hf
import httpx
import numpy as np
import pytest
import torch
from cases import BY_NAME, NEW_TOKENS, PROMPTS
from safetensors.torch import load_file

from services.trainer import rollout_state_dict
from tests.e2e.stack import Stack, start_stack
from tests.integration.trainer.test_publish_no_paddle import RUN

CASE = "qwen2-bf16"


@pytest.fixture(scope="module")
def stack(
    model_dirs: dict[str, Path], nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("versions"))
    model_dir = tmp / f"qwen2-{uuid.uuid4().hex[:6]}"  # unique on the session's server
    shutil.copytree(model_dirs[CASE], model_dir)
    ipc = tmp / "ipc"
    ipc.mkdir(mode=0o700)
    s = start_stack(
        tmp, nats_url, tp=2, model_dir=model_dir,
        env={"ROLLBUS_LOAD_STRATEGY": "ipc", "ROLLBUS_IPC_DIR": str(ipc),
             "ROLLBUS_MAX_MODEL_LEN": "64"},
    )  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def checkpoint(model_dir: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})
    return out


def assert_rollout_state_is(stack: Stack, model_dir: Path, version: str) -> None:
    got = rollout_state_dict(stack.nats_url, stack.instance)
    want = checkpoint(model_dir)
    assert got.version == version
    assert sorted(got) == sorted(want)  # HF names; no lm_head for tied embeddings
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        assert np.array_equal(got[name].astype(np.float32), w), name  # bf16 -> fp32 exact


def assert_serves(stack: Stack, model_dir: Path) -> None:
    tol = BY_NAME[CASE].tolerance
    for prompt in PROMPTS:
        ref = hf.reference(model_dir, prompt, NEW_TOKENS)
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == ref["tokens"]
        got = np.array(choice["logprobs"]["token_logprobs"])
        assert np.abs(got - ref["logprobs"]).max() < tol


def trained(base: Path, out: Path, seed: int, shard: str | None) -> Path:
    """The next version as a trainer writes it: transformers' model, weights moved,
    ``save_pretrained`` in bf16."""
    model = hf.load(base)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers." in name:
                p.add_(torch.randn_like(p) * 0.03)
    kw: dict[str, Any] = {"max_shard_size": shard} if shard else {}
    model.to(torch.bfloat16).save_pretrained(out, **kw)
    return out


def update(stack: Stack, version: str) -> list[str]:
    """Load ``version``; the files the ranks read."""
    with stack.client(timeout=120) as c:
        assert c.post("/v1/pause").status_code == 200
        try:
            r = c.post("/v1/update_weights", json={"version": version})
            assert r.status_code == 200, r.text
        finally:
            assert c.post("/v1/resume").status_code == 200
    return [f for rank in r.json()["result"]["ranks"] for f in rank["files"]]


def test_rollout_state_dict_is_the_served_checkpoint(stack: Stack) -> None:
    assert_rollout_state_is(stack, stack.model_dir, "v0")


@pytest.mark.parametrize("how", ["object_store", "ipc"])
def test_bf16_versions_published_by_the_cli(stack: Stack, tmp_path: Path, how: str) -> None:
    version = f"{how}-1"
    src = trained(stack.model_dir, tmp_path / version, len(how),
                  "60KB" if how == "object_store" else None)  # fmt: skip
    args = ["publish", str(src), "--model", stack.model_dir.name, "--version", version,
            "--tp", "2", "--nats-url", stack.nats_url]  # fmt: skip
    if how == "ipc":
        args.append("--ipc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    env.update(PYTHONPATH=os.getcwd(), ROLLBUS_IPC_DIR=stack.env["ROLLBUS_IPC_DIR"])
    r = subprocess.run([sys.executable, "-c", RUN, "-", *args], env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr  # and paddle was never imported
    files = update(stack, version)
    assert files and all(f.startswith("ipc ") == (how == "ipc") for f in files), files
    assert_serves(stack, src)
    assert_rollout_state_is(stack, src, version)
