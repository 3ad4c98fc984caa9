"""The staleness bound against real stacks (TP=1): versions published with the SDK are
counted with auto-update off, new requests wait while the serving version is over the
bound (running ones go on, /health stays 200), they proceed after update_weights; a
request's own ``max_staleness``; ``/v1/status`` ``staleness`` and the ``/metrics`` gauges;
with auto-update on, a request sent once a newer version is known is served on it."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from services.trainer.publisher import CheckpointPublisher
from tests.e2e.stack import Stack, model_config, module_stack
from tests.e2e.test_checkpoints import events, model_of, post, training_state, wait_for


@pytest.fixture(scope="module")
def sstack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"ROLLBUS_MAX_STALENESS": "1", "ROLLBUS_STALL_S": "2"}
    with module_stack(tmp_path_factory, nats_url, "st", tp=1, env=env) as s:
        yield s


def publish(stack: Stack, version: str, seed: int) -> None:
    pub = CheckpointPublisher(stack.nats_url)
    state = training_state(stack, seed)
    res = pub.publish(model_of(stack), version, state, tp=1, config=model_config(stack.model_dir))
    assert res.version == version


def complete(stack: Stack, **extra: Any) -> httpx.Response:
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, **extra}
    with stack.client(timeout=120) as c:
        return c.post("/v1/completions", json=body)


def staleness(stack: Stack) -> dict[str, Any]:
    return dict(stack.status()["staleness"])


def metric(stack: Stack, name: str) -> float:
    with stack.client() as c:
        text = c.get("/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def still_waiting(fut: Future[httpx.Response], for_s: float = 1.5) -> bool:
    time.sleep(for_s)
    return not fut.done()


def test_requests_wait_while_stale_and_proceed_after_update(sstack: Stack) -> None:
    st = staleness(sstack)
    assert st["behind"] == 0 and st["max_staleness"] == 1 and st["newest"] == ""
    assert metric(sstack, "rollbus_staleness_bound") == 1
    v0 = sstack.status()["weight_version"]

    # one version announced: 1 behind, within the bound of 1 (auto-update is off, the
    # engine still counts what the trainer announces)
    publish(sstack, "s1", seed=1)
    wait_for(lambda: staleness(sstack)["newest"] == "s1")
    assert staleness(sstack)["behind"] == 1 and not staleness(sstack)["stale"]
    r = complete(sstack)
    assert r.status_code == 200 and r.json()["weight_version"] == v0

    with ThreadPoolExecutor(4) as pool:
        # a request's own bound is tighter: max_staleness 0 waits at 1 behind
        strict = pool.submit(complete, sstack, max_staleness=0)
        wait_for(lambda: staleness(sstack)["waiting"] == 1)
        assert still_waiting(strict)
        # a long request running when the bound is crossed goes on
        # long enough to be seen running (48 tokens of the tiny model could end between two
        # polls on a loaded host); seen ended counts too: it must still say v0
        running = pool.submit(complete, sstack, max_tokens=256, ignore_eos=True)
        wait_for(lambda: running.done() or sstack.status()["running"] >= 1)
        publish(sstack, "s2", seed=2)
        wait_for(lambda: staleness(sstack)["behind"] == 2)
        st = staleness(sstack)
        assert st["stale"] and st["newest"] == "s2" and st["serving"] == v0
        plain = pool.submit(complete, sstack)
        chat = pool.submit(
            lambda: httpx.post(
                sstack.base_url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                timeout=120,
            )
        )
        wait_for(lambda: staleness(sstack)["waiting"] == 3)
        done = running.result(timeout=120)
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
        assert done.json()["weight_version"] == v0
        # waiting by design is no stall: /health stays 200 past STALL_S (2 s)
        time.sleep(2.5)
        assert httpx.get(sstack.base_url + "/health", timeout=5).status_code == 200
        assert not (strict.done() or plain.done() or chat.done())
        assert metric(sstack, "rollbus_staleness_versions") == 2
        assert metric(sstack, "rollbus_staleness_waiting") == 3
        st = sstack.status()
        assert st["queued"] == 3 and st["state"] == "running"

        # the trainer's update brings the engine within the bound: all three start
        assert post(sstack, "/v1/pause", params={"mode": "keep"}).status_code == 200
        r = post(sstack, "/v1/update_weights", json={"version": "s2"})
        assert r.status_code == 200, r.text
        assert post(sstack, "/v1/resume").status_code == 200
        for fut in (strict, plain, chat):
            res = fut.result(timeout=120)
            assert res.status_code == 200, res.text
            assert res.json()["weight_version"] == "s2"
    st = staleness(sstack)
    assert st == {**st, "behind": 0, "stale": False, "waiting": 0, "serving": "s2"}
    assert metric(sstack, "rollbus_staleness_versions") == 0
    assert metric(sstack, "rollbus_staleness_waiting") == 0


def test_a_waiting_request_whose_client_leaves_is_dropped(sstack: Stack) -> None:
    """Waiting is bounded by the client: one that gives up cancels its queued request."""
    publish(sstack, f"s-{uuid.uuid4().hex[:4]}", seed=3)
    wait_for(lambda: staleness(sstack)["behind"] >= 1)
    body = {"prompt": [1, 2], "max_tokens": 2, "max_staleness": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sstack.base_url + "/v1/completions", json=body, timeout=2)
    wait_for(lambda: staleness(sstack)["waiting"] == 0 and sstack.status()["requests"] == 0)


def test_bad_max_staleness_is_400(sstack: Stack) -> None:
    r = complete(sstack, max_staleness=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_staleness"


@pytest.fixture(scope="module")
def austack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"ROLLBUS_MAX_STALENESS": "0", "ROLLBUS_AUTO_UPDATE": "true"}
    with module_stack(tmp_path_factory, nats_url, "sa", tp=1, env=env) as s:
        yield s


def test_on_policy_with_auto_update(austack: Stack) -> None:
    """MAX_STALENESS=0 + auto-update. A version this engine cannot load (sharded for
    TP=2: no shard for its one rank) is announced: the update fails for good, the engine
    stays on its version, 1 behind, and new requests wait. The next loadable version is
    applied by auto-update, which brings the engine within the bound: the waiting request
    starts and is generated by that version alone."""
    v0 = austack.status()["weight_version"]
    pub = CheckpointPublisher(austack.nats_url)
    cfg = model_config(austack.model_dir)
    pub.publish(model_of(austack), "bad", training_state(austack, 5), tp=2, config=cfg)
    wait_for(lambda: staleness(austack)["newest"] == "bad")
    wait_for(lambda: any(e["data"]["action"] == "failed" for e in events(austack, "auto_update")))
    st = austack.status()
    assert st["weight_version"] == v0 and st["state"] == "running"
    assert st["staleness"]["behind"] == 1 and st["staleness"]["stale"]
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, austack, max_tokens=8, ignore_eos=True)
        wait_for(lambda: staleness(austack)["waiting"] == 1)
        assert still_waiting(waiting)
        publish(austack, "a1", seed=4)
        r = waiting.result(timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["weight_version"] == "a1" and "weight_versions" not in body
    st = staleness(austack)
    assert st["behind"] == 0 and st["serving"] == "a1" and st["waiting"] == 0
