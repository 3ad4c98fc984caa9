"""The engine SIGKILLed: the API answers 503 at once (no hang) while it is down, the
launcher restarts it, and it comes back in the state and version it had (read from the
KV bucket ``rollbus_state``) — an update it was running is rolled back everywhere."""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults import common as c
from tests.faults.common import Faults

pytestmark = pytest.mark.faults


def _engine_pid(f: Faults) -> int:
    return int(c.status(f.stack)["engine_pid"])


def _wait_new_engine(f: Faults, old: int) -> dict[str, object]:
    deadline = time.monotonic() + 120
    while True:
        st = c.wait_recovered(f.stack)
        if st["engine_pid"] != old:
            return st
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.3)


def test_engine_killed_comes_back_in_its_state_and_version(faults: Faults) -> None:
    f = faults
    assert c.ctl(f.stack, "/v1/pause").status_code == 200
    assert c.ctl(f.stack, "/v1/update_weights", json={"version": "v2"}).status_code == 200
    r = c.ctl(f.stack, "/v1/sleep", params={"tags": "weight,kv_cache"})
    assert r.status_code == 200, r.text
    old = _engine_pid(f)
    c.signal_quietly(old, signal.SIGKILL)
    # while it is down: answers, not hangs (503 naming the engine, or the new engine's
    # answer once it is back)
    for path in ("/health", "/v1/is_paused"):
        t0 = time.monotonic()
        r = c.get(f.stack, path, timeout=c.CONTROL_BOUND)
        assert time.monotonic() - t0 < c.CONTROL_BOUND
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert "engine" in r.text, r.text
    st = _wait_new_engine(f, old)
    assert st["state"] == "sleeping" and st["asleep"] == ["kv_cache", "weight"], st
    assert st["weight_version"] == "v2"
    assert [r["version"] for r in st["ranks"]] == ["v2", "v2"]
    assert not any(r["weights_loaded"] or r["kv_allocated"] for r in st["ranks"]), st
    r = c.ctl(f.stack, "/v1/wakeup")
    assert r.status_code == 200, r.text
    c.assert_consistent(f.stack, "v2")


def test_engine_stopped_one_hop_calls_answer_within_the_control_timeout(faults: Faults) -> None:
    """A stopped engine is not dead (nothing restarts it): a call that needs one hop
    answers 503 naming the engine within CONTROL_TIMEOUT_S + 5 s (not the bound of the
    two-scatter calls), /health is 503, and once continued it serves, unchanged."""
    f = faults
    pid = _engine_pid(f)
    c.signal_quietly(pid, signal.SIGSTOP)
    try:
        calls = [c.Call(f.stack, p) for p in ("/v1/pause", "/v1/resume")]
        t0 = time.monotonic()
        r = c.get(f.stack, "/v1/is_paused", timeout=c.CONTROL_BOUND)
        assert r.status_code == 503 and "engine: no reply" in r.text, r.text
        assert time.monotonic() - t0 < c.CT + 5 + 2
        for call in calls:
            r = call.result(c.CT + 5 + 2)
            assert r.status_code == 503 and "engine: no reply" in r.text, r.text
        assert c.get(f.stack, "/health").status_code == 503
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    # continued: the same engine serves again (the fixture resumes and checks the output)
    st = c.wait_recovered(f.stack)
    assert st["engine_pid"] == pid, st


def test_engine_killed_during_commit_rolls_back_everywhere(faults: Faults) -> None:
    """Killed while every rank sits in its commit window: the ranks commit with no
    engine left to roll them back; the restarted engine finds the update in progress in
    its record and rolls it back by id — all ranks on v1 again, never half-applied."""
    f = faults
    assert c.ctl(f.stack, "/v1/pause").status_code == 200
    assert c.ctl(f.stack, "/v1/update_weights", json={"version": "v1"}).status_code == 200
    needle = "rank 1: test delay before commit"
    before = c.log_count(f.stack, needle)
    old = _engine_pid(f)
    call = c.Call(f.stack, "/v1/update_weights", json={"version": "v2"})
    c.wait_log(f.stack, needle, before)
    c.signal_quietly(old, signal.SIGKILL)
    r = call.result(c.CONTROL_BOUND)
    assert r.status_code == 503, r.text
    st = _wait_new_engine(f, old)
    assert st["state"] == "paused" and st["weight_version"] == "v1", st
    assert [r["version"] for r in st["ranks"]] == ["v1", "v1"], st
    time.sleep(c.DELAY + 1)  # past the commit window: nothing moved meanwhile
    st = c.wait_recovered(f.stack)
    assert st["weight_version"] == "v1" and [r["version"] for r in st["ranks"]] == ["v1"] * 2
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    c.assert_consistent(f.stack, "v1")


def test_engine_killed_mid_stream_every_request_is_answered(faults: Faults) -> None:
    """The stream it was serving ends with an error (the API stops waiting when the
    engine's heartbeats stop); a request sent while it is down gets 503 at once (or is
    served by the restarted engine); then it serves again."""
    f = faults
    stream = c.Stream(f.stack)
    assert stream.started.wait(c.GEN_BOUND)
    old = _engine_pid(f)
    c.signal_quietly(old, signal.SIGKILL)
    t0 = killed = time.monotonic()
    body = {"model": "tiny", "prompt": c.PROMPT, "max_tokens": 4, "temperature": 0}
    r = c.ctl(f.stack, "/v1/completions", json=body, timeout=c.GEN_BOUND)
    assert time.monotonic() - t0 < c.GEN_BOUND
    assert r.status_code in (200, 503), r.text
    s = stream.result()
    assert s.outcome in ("done", "error"), (s.outcome, s.error, s.tokens)
    if s.outcome == "error":
        assert "engine" in str(s.error), s.error
        # the API stops waiting after CONTROL_TIMEOUT_S without a heartbeat, not later
        assert s.ended_at - killed < c.CT + c.MARGIN, s.ended_at - killed
    _wait_new_engine(f, old)
    c.assert_consistent(f.stack, "v0")


def test_engine_sigterm_ends_its_streams_at_once(faults: Faults) -> None:
    """An engine stopped with SIGTERM (an operator's ``kill``) tells its live requests
    before it exits — 503 `the engine is shutting down` — instead of leaving them to the
    API's idle timeout (CONTROL_TIMEOUT_S of silence); the launcher starts it again."""
    f = faults
    stream = c.Stream(f.stack)
    assert stream.started.wait(c.GEN_BOUND)
    old = _engine_pid(f)
    c.signal_quietly(old, signal.SIGTERM)
    t0 = time.monotonic()
    s = stream.result()
    assert s.outcome == "error", (s.outcome, s.error, s.tokens)
    assert "the engine is shutting down" in str(s.error), s.error
    assert s.error["code"] == 503, s.error
    assert s.ended_at - t0 < c.CT, s.ended_at - t0  # not the API's idle timeout
    _wait_new_engine(f, old)
    assert "engine exited with code 0; restarting it" in f.stack.log.read_text()
    c.assert_consistent(f.stack, "v0")


def test_a_new_stack_starts_fresh_not_from_the_stored_state(
    tmp_path_factory: pytest.TempPathFactory, nats_url: str
) -> None:
    """Only an engine restarted beside live ranks restores; `rollbus serve` started again
    on the same NATS and instance runs from the model dir, like any server. (TP=1: the
    stored state is the engine's, whatever the rank count.)"""
    from tests.e2e.stack import start_stack

    tmp = tmp_path_factory.mktemp("fresh")
    env = {"ROLLBUS_INSTANCE": f"fresh{int(time.time() * 1000) % 10**8}"}
    first = start_stack(tmp, nats_url, tp=1, env=env)
    try:
        assert c.ctl(first, "/v1/pause", params={"mode": "keep"}).status_code == 200
        assert c.status(first)["state"] == "paused"
    finally:
        first.stop()
    second = start_stack(tmp, nats_url, tp=1, env=env)
    try:
        st = c.status(second)
        assert st["state"] == "running" and not st["is_paused"], st
    finally:
        second.stop()
