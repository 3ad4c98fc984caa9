"""A checkpoint with a NaN/Inf weight is refused by the publisher by default (a version
that serves finite, near-uniform logprobs would have an RL run train on garbage): one
error naming the tensor, and nothing left behind — no shard, no chunk, no event, the
claim released. ``allow_nonfinite=True`` / ``--allow-nonfinite`` publishes it. Real
publisher, real nats-server, the real CLI process."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from services.tiny_model import TINY_CONFIG
from services.trainer import names, shards
from services.trainer.publisher import CheckpointPublisher, VersionConflict
from services.trainer.shards import NonFiniteWeight
from shared import objstore, sharding
from shared.bus import Bus
from shared.model_config import ModelConfig
from shared.subjects import ckpt_object_name
from tests.clirun import clean_env, rollbus

# ~12 MiB fp32 at tp=2: each shard spans several chunks, so some are sent before the
# bad block is reached (and must be purged)
CFG = {
    **TINY_CONFIG,
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
BUCKET = "rollbus_ckpt"
LAST_DOWN = "model.layers.1.mlp.down_proj.weight"


def _hf(bad: str | None, value: float) -> dict[str, np.ndarray]:
    w = sharding.init_weights(ModelConfig.from_hf(CFG), 7)
    if bad is not None:
        w[bad] = w[bad].copy()
        w[bad][-1, -1] = value
    return w


async def _nothing_stored(url: str, model: str, version: str, tp: int, nuids: list[str]) -> None:
    bus = await Bus.connect(url, "check")
    try:
        js = bus.nc.jetstream()
        for r in range(tp):
            name = ckpt_object_name(model, version, f"rank{r}-of-{tp}.safetensors")
            _, info = await objstore.last_meta(bus.nc, BUCKET, name)
            assert not info or info.get("deleted"), info  # no shard object
        assert len(nuids) == tp
        for nuid in nuids:  # the chunk subjects the publish wrote to (or would have)
            st = await js.stream_info(f"OBJ_{BUCKET}", subjects_filter=f"$O.{BUCKET}.C.{nuid}")
            assert not st.state.subjects, st.state.subjects  # no chunk left
        _, claim = await objstore.last_meta(
            bus.nc, BUCKET, ckpt_object_name(model, version, "manifest.json")
        )
        assert claim.get("deleted") and "claim" not in claim  # no manifest; released
        await objstore.ensure_ckpt_stream(bus.nc, model)
        assert not await objstore.list_versions(bus.nc, model)  # no event
    finally:
        await bus.close()


@pytest.mark.parametrize(
    "bad,value,what",
    [
        (LAST_DOWN, float("nan"), "NaN"),  # a transposed training tensor: copied, tiled
        ("model.embed_tokens.weight", -np.inf, "Inf"),  # contiguous: sent from the source
    ],
)
async def test_a_non_finite_state_dict_is_refused_and_nothing_is_left(
    nats_url: str, bad: str, value: float, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    nuids: list[str] = []
    real = objstore.new_nuid

    def new_nuid(nc: Any) -> str:
        nuids.append(real(nc))
        return nuids[-1]

    monkeypatch.setattr(objstore, "new_nuid", new_nuid)
    cfg = ModelConfig.from_hf(CFG)
    train = names.to_training(_hf(bad, value), cfg)
    model, pub = f"nf-{uuid.uuid4().hex[:6]}", CheckpointPublisher(nats_url)
    with pytest.raises(NonFiniteWeight, match=f"tensor {bad} holds {what}") as e:
        await pub.apublish(model, "v1", train, tp=2, config=CFG)
    assert e.value.tensor == bad
    await _nothing_stored(nats_url, model, "v1", 2, nuids)
    # the opt-out publishes the very same state dict (the claim was released)
    res = await pub.apublish(model, "v1", train, tp=2, config=CFG, allow_nonfinite=True)
    assert res.uploaded and res.seq > 0


async def test_ipc_publish_refuses_too(nats_url: str, tmp_path: Path) -> None:
    pub = CheckpointPublisher(nats_url, ipc_dir=tmp_path / "ipc")
    state = names.to_training(_hf(LAST_DOWN, np.inf), ModelConfig.from_hf(CFG))
    with pytest.raises(NonFiniteWeight, match=LAST_DOWN):
        await pub.apublish("nfi", "v1", state, tp=2, config=CFG, ipc=True)
    assert not (tmp_path / "ipc").exists()  # refused before anything was written


def test_cli_refuses_a_model_dir_with_nan_in_one_line(nats_url: str, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    save_file(_hf(LAST_DOWN, float("nan")), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CFG))
    model, env = f"nfc-{uuid.uuid4().hex[:6]}", clean_env(tmp_path / "data")
    args: list[Any] = [
        "publish",
        str(d),
        "--model",
        model,
        "--version",
        "v1",
        "--tp",
        "2",
        "--nats-url",
        nats_url,
    ]
    r = rollbus(*args, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rollbus publish: tensor {LAST_DOWN} holds NaN")
    assert "--allow-nonfinite" in lines[0] and not r.stdout
    r = rollbus(*args, "--allow-nonfinite", env=env)
    assert r.returncode == 0 and r.stdout.startswith(f"published {model}/v1"), r.stderr


async def test_every_failed_fill_is_retrieved(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replicated tensor with a NaN fails every rank's fill: the rank whose upload is
    cancelled before it looked at its fill (here: still waiting for the server) must not
    leave that failure unretrieved — asyncio then logs "Future exception was never
    retrieved" with a traceback, a multi-line stderr for `rollbus publish`."""
    rank1_failed = threading.Event()
    real_fill, real_put = shards.ShardLayout.fill, objstore.put_object

    def fill(self: shards.ShardLayout, *a: Any, **k: Any) -> None:
        try:
            real_fill(self, *a, **k)
        except NonFiniteWeight:
            if self.rank == 1:
                rank1_failed.set()
            raise

    async def put_object(nc: Any, bucket: str, name: str, *a: Any, **k: Any) -> Any:
        if name.endswith("rank1-of-2.safetensors"):
            await asyncio.Event().wait()  # a slow server: cancelled, never reads its fill
        await asyncio.to_thread(rank1_failed.wait, 30)  # rank 1's fill has failed first
        return await real_put(nc, bucket, name, *a, **k)

    monkeypatch.setattr(shards.ShardLayout, "fill", fill)
    monkeypatch.setattr(objstore, "put_object", put_object)
    state = _hf(None, 0.0)
    state["model.norm.weight"] = state["model.norm.weight"].copy()
    state["model.norm.weight"][-1] = np.nan  # replicated: in both shards
    seen: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, ctx: seen.append(ctx))
    try:
        pub = CheckpointPublisher(nats_url)
        with pytest.raises(NonFiniteWeight, match="model.norm.weight"):
            await pub.apublish(f"nfr-{uuid.uuid4().hex[:6]}", "v1", state, tp=2, config=CFG)
        assert rank1_failed.is_set()
        for _ in range(3):
            await asyncio.sleep(0)
            gc.collect()
    finally:
        loop.set_exception_handler(old)
    assert not seen, [c.get("message") for c in seen]


@pytest.mark.parametrize("ipc", [False, True], ids=["object-store", "ipc"])
def test_republishing_a_non_finite_version_without_the_flag_says_what_happened(
    nats_url: str, tmp_path: Path, ipc: bool
) -> None:
    """A version published with --allow-nonfinite is live: re-publishing it without the
    flag follows the re-publish rules — the same bytes are a no-op ("already
    published", with one warning naming the bad tensor), other bytes are refused as
    versions are (immutable). Before, both said "… is not published" though it was."""
    d, other = tmp_path / "m", tmp_path / "other"
    for where, seed_value in ((d, float("nan")), (other, -np.inf)):
        where.mkdir()
        save_file(_hf(LAST_DOWN, seed_value), str(where / "model.safetensors"))
        (where / "config.json").write_text(json.dumps(CFG))
    model, env = f"nfa-{uuid.uuid4().hex[:6]}", clean_env(tmp_path / "data")
    env["ROLLBUS_IPC_DIR"] = str(tmp_path / "ipc")

    # the SDK around the one CLI run whose output is checked (each CLI run costs seconds)
    pub = CheckpointPublisher(nats_url, ipc_dir=tmp_path / "ipc")

    def sdk(src: Path, allow: bool) -> Any:
        return asyncio.run(
            pub.apublish(model, "v1", str(src), tp=2, ipc=ipc, allow_nonfinite=allow)
        )

    assert sdk(d, True).uploaded
    argv = [*("publish", str(d), "--model", model, "--version", "v1", "--tp", "2")]
    r = rollbus(*argv, "--nats-url", nats_url, *(["--ipc"] if ipc else []), env=env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.startswith(f"already published {model}/v1"), r.stdout
    assert "not published" not in r.stderr and f"{LAST_DOWN} holds NaN" in r.stderr, r.stderr
    with pytest.raises(VersionConflict, match="different content"):
        sdk(other, False)
