"""bf16 and fp16 checkpoints through every load strategy into real TP=2 stacks.

One stack (``ROLLBUS_LOAD_STRATEGY=ipc``, which falls back to ``snapshot`` and then to
``object_store`` for a version it does not find, README *Checkpoints*) loads each kind of
version through the source that holds it: ``snapshot`` (a sharded HF dir ``versions/V/`` with its
``model.safetensors.index.json``), ``object_store`` (``rollbus publish DIR``) and ``ipc``
(the SDK writing to shared memory). A bf16 and an fp16 HF checkpoint of the same weights
is loaded with ``update_weights`` and served: greedy tokens equal the fp32 reference of
those weights (the in-process model), every rank holds exactly the fp32 values (its
weights digest), and each rank's reply names the files it read.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.trainer.publisher import CheckpointPublisher
from shared import sharding
from shared.model_config import ModelConfig
from tests.e2e.reference import greedy
from tests.e2e.stack import Stack, model_config, start_stack
from tests.e2e.test_control import digests

TP = 2
PROMPT = "rollout"


def write_st(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file written by hand (name -> (dtype, raw array of its bytes))."""
    header: dict[str, Any] = {}
    blobs, off = [], 0
    for name, (dtype, raw) in tensors.items():
        data = np.ascontiguousarray(raw).tobytes()
        header[name] = {"dtype": dtype, "shape": list(raw.shape),
                        "data_offsets": [off, off + len(data)]}  # fmt: skip
        blobs.append(data)
        off += len(data)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def encode(w: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # truncated to bf16: the upper half of each float32
        return (np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return w.astype(np.float16)


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """The fp32 values a bf16 / fp16 tensor stands for: the reference weights."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def hf_dir(d: Path, config: dict[str, Any], w: dict[str, np.ndarray], dtype: str) -> Path:
    """An HF checkpoint in ``dtype``, sharded over two files with an index (as
    ``save_pretrained`` writes a large model)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    names = list(w)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(parts):
        f = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        write_st(d / f, {n: (dtype, encode(w[n], dtype)) for n in part})
        weight_map.update(dict.fromkeys(part, f))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return d


def rank_digest(cfg: ModelConfig, ref: dict[str, np.ndarray], rank: int) -> str:
    """services.worker.weights.digest of the rank's fp32 tensors, computed here."""
    h = hashlib.sha256()
    for name in sorted(sharding.full_shapes(cfg)):
        h.update(name.encode())
        h.update(sharding.shard_tensor(cfg, name, ref[name], rank, TP).tobytes())
    return h.hexdigest()


def slice_bytes(cfg: ModelConfig, rank: int, itemsize: int) -> int:
    return sum(
        int(np.prod(sharding.shard_shape(cfg, n, s, rank, TP))) * itemsize
        for n, s in sharding.full_shapes(cfg).items()
    )


@pytest.fixture(scope="module")
def dstack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("dtypes"))
    ipc = tmp / "ipc"
    ipc.mkdir(mode=0o700)
    s = start_stack(
        tmp,
        nats_url,
        tp=TP,
        model_name=f"dt-{uuid.uuid4().hex[:6]}",
        env={"ROLLBUS_LOAD_STRATEGY": "ipc", "ROLLBUS_IPC_DIR": str(ipc)},
    )
    try:
        yield s
    finally:
        s.stop()


def post(stack: Stack, path: str, **kw: Any) -> Any:
    with stack.client() as c:
        return c.post(path, **kw)


def load_and_generate(stack: Stack, version: str, verify: bool) -> tuple[dict[str, Any], Any]:
    assert post(stack, "/v1/pause").status_code == 200
    try:
        r = post(
            stack, "/v1/update_weights", json={"version": version, "verify_checksum": verify}
        )
        assert r.status_code == 200, r.text
    finally:
        assert post(stack, "/v1/resume").status_code == 200
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    out = post(stack, "/v1/completions", json=body)
    assert out.status_code == 200, out.text
    return r.json()["result"], out.json()


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
@pytest.mark.parametrize("path", ["snapshot", "object_store", "ipc"])
def test_half_precision_checkpoint_serves_its_fp32_reference(
    dstack: Stack, tmp_path: Path, path: str, dtype: str
) -> None:
    config = model_config(dstack.model_dir)
    cfg = ModelConfig.from_hf(config)
    seed = {"snapshot": 41, "object_store": 42, "ipc": 43}[path] + (10 if dtype == "F16" else 0)
    w = sharding.init_weights(cfg, seed)
    ref = {n: decode(encode(a, dtype), dtype) for n, a in w.items()}
    model, version = dstack.model_dir.name, f"{path}-{dtype.lower()}"
    if path == "snapshot":
        hf_dir(dstack.model_dir / "versions" / version, config, w, dtype)
    else:
        src = hf_dir(tmp_path / "hf", config, w, dtype)
        if path == "object_store":  # the CLI, which must not need the worker's paddle
            env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
            r = subprocess.run(
                [sys.executable, "-m", "services.cli", "publish", str(src), "--model", model,
                 "--version", version, "--tp", str(TP), "--nats-url", dstack.nats_url],
                capture_output=True, text=True, timeout=120, env=env,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
        else:
            pub = CheckpointPublisher(dstack.nats_url, ipc_dir=dstack.env["ROLLBUS_IPC_DIR"])
            assert pub.publish(model, version, src, tp=TP, ipc=True).ipc

    res, out = load_and_generate(dstack, version, verify=path != "snapshot")
    prompt = [256, *PROMPT.encode()]
    assert out["weight_version"] == version
    assert out["choices"][0]["token_ids"] == greedy(dstack.model_dir, prompt, 12, weights=ref)
    assert digests(dstack) == {r: rank_digest(cfg, ref, r) for r in range(TP)}

    ranks = sorted(res["ranks"], key=lambda x: x["rank"])
    for r, x in enumerate(ranks):
        files = " ".join(x["files"])
        if path == "snapshot":
            # each rank read exactly its slices' bytes from the two files, in the stored
            # 2-byte dtype: about half of the split tensors, not the whole checkpoint
            assert "model-00001-of-00002" in files and "model-00002-of-00002" in files
            assert x["bytes"] == slice_bytes(cfg, r, 2)
            assert x["bytes"] < slice_bytes(cfg, r, 2) * TP
        elif path == "object_store":
            assert f"{version}/rank{r}-of-{TP}.safetensors" in files and "ipc" not in files
            assert x["verified"]
        else:
            assert files.startswith("ipc ") and x["verified"]
        if path != "snapshot":  # the shard holds the 2-byte data as published
            assert slice_bytes(cfg, r, 2) < x["bytes"] < slice_bytes(cfg, r, 2) + 65536
