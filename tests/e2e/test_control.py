"""Every control route through a real stack (API + engine + 2 paddle ranks + NATS)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from safetensors.numpy import load_file

from services.tiny_model import write_version
from services.trainer.shards import write_sharded_dir
from shared import sharding
from shared.bus import Bus
from shared.model_config import ModelConfig
from shared.subjects import Subjects
from tests.e2e.stack import Stack, free_port, model_config, wait_healthy


def post(stack: Stack, path: str, **kw: Any) -> httpx.Response:
    with stack.client() as c:
        return c.post(path, **kw)


def get(stack: Stack, path: str, **kw: Any) -> httpx.Response:
    with stack.client() as c:
        return c.get(path, **kw)


def rank_call(stack: Stack, method: str) -> dict[int, dict[str, Any]]:
    """Ask every rank directly (worker.ctl.<method>) — test-side observation only."""

    async def go() -> dict[int, dict[str, Any]]:
        bus = await Bus.connect(stack.nats_url, "test-observer")
        try:
            reps = await bus.scatter(
                Subjects(stack.instance).worker_ctl(method), b"{}", expected=2, timeout=20
            )
            return {r: json.loads(rep.data) for r, rep in reps.items()}
        finally:
            await bus.close()

    return asyncio.run(go())


def digests(stack: Stack) -> dict[int, str]:
    out = rank_call(stack, "digest")
    assert all(v["error_code"] == 200 for v in out.values()), out
    return {r: v["result"]["sha256"] for r, v in out.items()}


@pytest.fixture(autouse=True)
def back_to_running(stack: Stack) -> Any:
    """Each test leaves the shared stack running and awake."""
    yield
    st = stack.status()
    if st["state"] == "sleeping":
        post(stack, "/v1/wakeup")
    post(stack, "/v1/resume")
    assert stack.status()["state"] == "running"


def test_health_and_status_keys(stack: Stack) -> None:
    assert get(stack, "/health").status_code == 200
    st = stack.status()
    for key in ("state", "is_paused", "weight_version", "model", "ranks", "nats_url"):
        assert key in st
    assert st["state"] == "running" and st["is_paused"] is False
    assert st["weight_version"] == "v0" and st["model"] == "tiny"
    assert [r["rank"] for r in st["ranks"]] == [0, 1]
    assert all(r["alive"] and r["weights_loaded"] and r["kv_allocated"] for r in st["ranks"])
    assert st["nats_url"] == stack.nats_url


def test_pause_resume_is_paused(stack: Stack) -> None:
    assert get(stack, "/v1/is_paused").json() == {"is_paused": False}
    for mode in ("abort", "wait", "keep"):
        r = post(stack, f"/v1/pause?mode={mode}")
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"request_id", "error_code", "error_message", "result"}
        assert body["error_code"] == 200 and body["result"]["is_paused"] is True
        assert post(stack, "/v1/pause").status_code == 200  # idempotent
        assert get(stack, "/v1/is_paused").json() == {"is_paused": True}
        assert stack.status()["state"] == "paused"
        assert post(stack, "/v1/resume").status_code == 200
        assert get(stack, "/v1/is_paused").json() == {"is_paused": False}
    assert post(stack, "/v1/resume").status_code == 200  # no-op when not paused
    r = post(stack, "/v1/pause?mode=sometimes")
    assert r.status_code == 400 and "mode" in r.json()["error_message"]


def test_raw_nats_json_control(stack: Stack) -> None:
    """What `nats req rollbus.<i>.ctl.pause '{}'` does: plain nats-py, none of our code."""
    prefix = f"rollbus.{stack.instance}.ctl"

    async def go() -> list[dict[str, Any]]:
        nc = await nats.connect(stack.nats_url)
        try:
            out = []
            for method in ("is_paused", "pause", "is_paused", "resume", "is_paused"):
                msg = await nc.request(f"{prefix}.{method}", b"{}", timeout=10)
                out.append(json.loads(msg.data))
            msg = await nc.request(f"{prefix}.pause", b'{"mode": "never"}', timeout=10)
            out.append(json.loads(msg.data))
            return out
        finally:
            await nc.close()

    r = asyncio.run(go())
    assert [x["result"]["is_paused"] for x in r[:5]] == [False, True, True, False, False]
    assert all(x["error_code"] == 200 and x["request_id"] for x in r[:5])
    assert r[5]["error_code"] == 400


def test_update_weights_switches_every_rank_and_back(stack: Stack) -> None:
    write_version(stack.model_dir, "v1", seed=1)
    before = digests(stack)
    assert post(stack, "/v1/update_weights", json={"version": "v1"}).status_code == 409
    assert post(stack, "/v1/pause").status_code == 200
    r = post(stack, "/v1/update_weights", json={"version": "v1"})
    assert r.status_code == 200, r.text
    res = r.json()["result"]
    assert res["version"] == "v1" and res["previous_version"] == "v0"
    assert res["bytes"] > 0 and [x["rank"] for x in res["ranks"]] == [0, 1]
    assert all("load_s" in x for x in res["ranks"])
    st = stack.status()
    assert st["weight_version"] == "v1" and st["state"] == "paused"  # does not resume
    assert {x["version"] for x in st["ranks"]} == {"v1"}
    after = digests(stack)
    assert all(after[r] != before[r] for r in (0, 1))
    # default version: the model dir's version.txt (v0)
    r = post(stack, "/v1/update_weights")
    assert r.status_code == 200 and r.json()["result"]["version"] == "v0"
    assert digests(stack) == before


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"version": 3}, 400, "version"),
        ({"version": "v0", "verify_checksum": "yes"}, 400, "verify_checksum"),
        ({"version": "does-not-exist"}, 404, "does-not-exist"),
        ("{not json", 400, "JSON"),
    ],
)
def test_update_weights_bad_input(stack: Stack, body: Any, status: int, needle: str) -> None:
    post(stack, "/v1/pause")
    before = digests(stack)
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = post(stack, "/v1/update_weights", **kw)
    assert r.status_code == status and r.json()["error_code"] == status
    assert needle in r.json()["error_message"]
    assert digests(stack) == before and stack.status()["weight_version"] == "v0"


def _sharded_version(stack: Stack, name: str, seed: int) -> Path:
    cfg = ModelConfig.from_hf(model_config(stack.model_dir))
    d = stack.model_dir / "versions" / name
    if d.exists():
        shutil.rmtree(d)
    write_sharded_dir(d, cfg, sharding.init_weights(cfg, seed), 2, "tiny", name)
    return d


def test_all_or_nothing_when_one_rank_fails(stack: Stack) -> None:
    d = _sharded_version(stack, "broken", seed=7)
    shard = d / "rank1-of-2.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # corrupt on rank 1 only (a short file is one still being copied: 404)
    shard.write_bytes(bytes(data))
    post(stack, "/v1/pause")
    before = digests(stack)
    r = post(stack, "/v1/update_weights", json={"version": "broken"})
    assert r.status_code == 422, r.text
    msg = r.json()["error_message"]
    assert "rank 1" in msg and "rank 0" not in msg
    st = stack.status()
    assert st["weight_version"] == "v0" and {x["version"] for x in st["ranks"]} == {"v0"}
    assert digests(stack) == before  # rank 0 staged fine but did not switch
    shard.unlink()  # missing shard (not copied yet: 404), same outcome
    r = post(stack, "/v1/update_weights", json={"version": "broken"})
    assert r.status_code == 404 and "rank 1" in r.json()["error_message"], r.text
    assert digests(stack) == before


def test_shape_mismatch_is_422(stack: Stack) -> None:
    cfg_dict = {**model_config(stack.model_dir), "intermediate_size": 256}
    cfg = ModelConfig.from_hf(cfg_dict)
    d = stack.model_dir / "versions" / "wrong-shape"
    d.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(sharding.init_weights(cfg, 3), str(d / "model.safetensors"))
    post(stack, "/v1/pause")
    r = post(stack, "/v1/update_weights", json={"version": "wrong-shape"})
    assert r.status_code == 422 and "shape" in r.json()["error_message"]
    assert stack.status()["weight_version"] == "v0"


def test_verify_checksum(stack: Stack) -> None:
    d = _sharded_version(stack, "checked", seed=11)
    post(stack, "/v1/pause")
    r = post(stack, "/v1/update_weights", json={"version": "checked", "verify_checksum": True})
    assert r.status_code == 200, r.text
    assert all("verify_s" in x for x in r.json()["result"]["ranks"])
    # sharded snapshot equals what a rank computes from HF files of the same weights
    ref = load_file(str(d / "rank0-of-2.safetensors"))
    assert set(ref) == set(sharding.shard_names(ModelConfig.from_hf(model_config(stack.model_dir))))
    # flip bytes inside rank 0's tensor data, same size: only SHA-256 can tell
    f = d / "rank0-of-2.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-8:] = bytes(8)
    f.write_bytes(bytes(raw))
    assert post(stack, "/v1/update_weights", json={"version": "v0"}).status_code == 200
    before = digests(stack)
    r = post(stack, "/v1/update_weights", json={"version": "checked", "verify_checksum": True})
    assert r.status_code == 422, r.text
    assert "rank 0" in r.json()["error_message"] and "SHA-256" in r.json()["error_message"]
    assert digests(stack) == before
    # a plain HF snapshot has no manifest: 400 rather than a silent pass
    write_version(stack.model_dir, "v1", seed=1)
    r = post(stack, "/v1/update_weights", json={"version": "v1", "verify_checksum": True})
    assert r.status_code == 400 and "manifest" in r.json()["error_message"]
    assert stack.status()["weight_version"] == "v0"


def test_sleep_and_wakeup(stack: Stack) -> None:
    before = digests(stack)
    assert post(stack, "/v1/sleep?tags=weight,gpu").status_code == 400
    r = post(stack, "/v1/sleep")
    assert r.status_code == 200, r.text
    assert r.json()["result"]["tags"] == ["weight", "kv_cache"]
    st = stack.status()
    assert st["state"] == "sleeping" and st["is_paused"] is True
    assert not any(x["weights_loaded"] or x["kv_allocated"] for x in st["ranks"])
    assert post(stack, "/v1/resume").status_code == 409
    # a sleeping engine accepts update_weights (validated, recorded, loaded at wakeup)
    r = post(stack, "/v1/update_weights", json={"version": "v0"})
    assert r.status_code == 200, r.text
    assert stack.status()["state"] == "sleeping"
    r = post(stack, "/v1/wakeup?tags=kv_cache")
    assert r.status_code == 200 and stack.status()["state"] == "sleeping"
    r = post(stack, "/v1/wakeup?tags=weight")
    assert r.status_code == 200, r.text
    st = stack.status()
    assert st["state"] == "running" and st["weight_version"] == "v0"
    assert all(x["weights_loaded"] and x["kv_allocated"] for x in st["ranks"])
    assert digests(stack) == before


def test_wakeup_reloads_the_current_version(stack: Stack) -> None:
    write_version(stack.model_dir, "v1", seed=1)
    post(stack, "/v1/pause")
    assert post(stack, "/v1/update_weights", json={"version": "v1"}).status_code == 200
    v1 = digests(stack)
    assert post(stack, "/v1/sleep?tags=weight").status_code == 200
    assert post(stack, "/v1/wakeup?tags=weight").status_code == 200
    assert digests(stack) == v1 and stack.status()["weight_version"] == "v1"
    post(stack, "/v1/pause")
    assert post(stack, "/v1/update_weights", json={"version": "v0"}).status_code == 200


def test_query_forms_and_json_errors(stack: Stack) -> None:
    # repeated tags are joined; an empty mode means the default (abort)
    r = post(stack, "/v1/sleep?tags=weight&tags=kv_cache")
    assert r.status_code == 200 and r.json()["result"]["tags"] == ["weight", "kv_cache"]
    assert post(stack, "/v1/wakeup?tags=").status_code == 200
    r = post(stack, "/v1/pause?mode=")
    assert r.status_code == 200 and r.json()["result"]["mode"] == "abort"
    # unknown routes and wrong methods answer JSON too
    r = get(stack, "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = get(stack, "/v1/pause")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_legacy_routes(stack: Stack) -> None:
    r = get(stack, "/clear_load_weight")
    assert r.status_code == 200 and stack.status()["state"] == "sleeping"
    r = get(stack, "/update_model_weight")
    assert r.status_code == 200 and stack.status()["state"] == "running"


def test_missing_rank_is_named_and_concurrent_op_is_409(stack: Stack) -> None:
    """Freeze rank 1: update_weights waits, a second op gets 409, the update ends 503
    naming rank 1, and nothing switched."""
    pid = next(r["pid"] for r in stack.status()["ranks"] if r["rank"] == 1)
    write_version(stack.model_dir, "v1", seed=1)
    post(stack, "/v1/pause")
    before = digests(stack)
    result: dict[str, httpx.Response] = {}
    os.kill(pid, signal.SIGSTOP)
    try:
        t = threading.Thread(
            target=lambda: result.setdefault(
                "r", post(stack, "/v1/update_weights", json={"version": "v1"})
            )
        )
        t.start()
        time.sleep(1.0)
        r2 = post(stack, "/v1/pause")
        assert r2.status_code == 409 and "in progress" in r2.json()["error_message"]
        assert get(stack, "/v1/is_paused").json() == {"is_paused": True}  # reads still answer
        t.join(60)
    finally:
        os.kill(pid, signal.SIGCONT)
    r = result["r"]
    assert r.status_code == 503, r.text
    assert "[1]" in r.json()["error_message"]
    time.sleep(0.5)
    assert digests(stack) == before
    st = stack.status()
    assert st["weight_version"] == "v0" and {x["version"] for x in st["ranks"]} == {"v0"}


def test_events_are_audited_in_jetstream(stack: Stack) -> None:
    post(stack, "/v1/pause?mode=wait")
    post(stack, "/v1/resume")

    async def go() -> list[dict[str, Any]]:
        nc = await nats.connect(stack.nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info("ROLLBUS_EVENTS")
            assert f"rollbus.{stack.instance}.events.>" in info.config.subjects
            sub = await js.subscribe(f"rollbus.{stack.instance}.events.>", ordered_consumer=True)
            out = []
            while True:
                try:
                    msg = await sub.next_msg(timeout=1)
                except nats.errors.TimeoutError:
                    break
                out.append(json.loads(msg.data))
            return out
        finally:
            await nc.close()

    events = asyncio.run(go())
    controls = [e for e in events if e["kind"] == "control"]
    assert any(
        e["data"]["method"] == "pause" and e["data"]["args"] == {"mode": "wait"} for e in controls
    )
    assert any(e["data"]["actor"].startswith("http:") for e in controls)
    states = [e["data"]["state"] for e in events if e["kind"] == "state"]
    assert "paused" in states and "running" in states
    assert any(e["kind"] == "ready" for e in events)


def test_metrics(stack: Stack) -> None:
    post(stack, "/v1/pause")
    text = get(stack, "/metrics").text
    assert 'rollbus_control_requests_total{code="200",method="pause"}' in text
    assert "rollbus_is_paused 1.0" in text
    assert "rollbus_ranks_alive 1.0" in text
    with stack.client() as c:
        c.post("/v1/resume")
        # ignore_eos: a sampled EOS would end it with "stop", not the "length" counted below
        r = c.post("/v1/completions",
                   json={"model": "tiny", "prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
    text = get(stack, "/metrics").text
    count = next(ln for ln in text.splitlines()
                 if ln.startswith("rollbus_time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1
    assert 'rollbus_generation_requests_total{finish_reason="length",route="completions"}' in text
    # what a Prometheus scraper reads: every family parses, names and types valid
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert fams["rollbus_generation_errors"] == "counter"
    assert fams["rollbus_generation_requests"] == "counter"


def test_admin_token_and_dynamic_load_off(stack: Stack, tmp_path: Path) -> None:
    """A second API process on the same instance, with a token and dynamic load off."""
    port = free_port()
    env = {
        **stack.env,
        "ROLLBUS_API_PORT": str(port),
        "ROLLBUS_ADMIN_TOKEN": "s3cret",
        "ROLLBUS_DYNAMIC_LOAD_WEIGHT": "false",
        "ROLLBUS_API_KEY": "k3y",
    }
    log = tmp_path / "api.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.api"],
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log, timeout=60)
        with httpx.Client(base_url=base, timeout=30) as c:
            assert c.post("/v1/pause").status_code == 401
            assert c.post("/v1/pause", headers={"Authorization": "Bearer nope"}).status_code == 401
            assert c.get("/v1/is_paused").status_code == 401
            r = c.post("/v1/update_weights", content=b"{bad json")
            assert r.status_code == 401  # auth is checked before the body
            auth = {"Authorization": "Bearer s3cret"}
            assert c.post("/v1/pause", headers=auth).status_code == 200
            assert c.post("/v1/resume", headers=auth).status_code == 200
            r = c.get("/clear_load_weight", headers=auth)
            assert r.status_code == 404 and r.json() == {"error": "Dynamic Load Weight Disabled."}
            assert c.get("/update_model_weight", headers=auth).status_code == 404
            assert c.get("/health").status_code == 200  # not a control route
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
            assert c.get("/v1/models").status_code == 401
            r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer k3y"})
            assert r.status_code == 200
            # the admin token is not an API key, and the other way round
            assert c.post("/v1/completions", json=body, headers=auth).status_code == 401
            assert c.post("/v1/pause", headers={"Authorization": "Bearer k3y"}).status_code == 401
    finally:
        proc.terminate()
        proc.wait(10)
