"""Stopped, not dead: a process SIGSTOPped while a client streams. Every stream ends
within the bound the README states (an error naming what is silent, never a hang), and
once the process is continued the engine holds no request nobody reads any more: the
state it reports (``running``/``waiting``, ``/health``) is true again."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import nats.errors
import pytest

from shared.bus import REQUEST_ID, Bus
from tests.e2e.procs import wait_stopped
from tests.faults import common as c
from tests.faults.common import Faults, NatsProc

pytestmark = pytest.mark.faults

ORPHAN_BOUND = c.ORPHAN_BOUND
# the API ends a stream after CONTROL_TIMEOUT_S without a chunk or heartbeat
STREAM_BOUND = c.CT + c.MARGIN
HELD = c.CT + 4  # stopped for longer than every per-call timeout of the API


def _until_no_requests(f: Faults, since: float, bound: float) -> None:
    while (n := c.engine_requests(f.stack)) != 0:
        assert time.monotonic() - since < bound, f"{n} requests still in the engine"
        time.sleep(0.2)


def _streams_fail_health_says_so(
    f: Faults, streams: list[c.Stream], stopped: float, says: str = ""
) -> None:
    """Each stream ends with an error (naming ``says``) within STREAM_BOUND of the stop,
    ``/health`` answers 503 within its bound; then the process stays stopped until HELD."""
    for s in streams:
        s.result(STREAM_BOUND)
        assert s.outcome == "error" and says in str(s.error), (s.outcome, s.error, s.tokens)
        assert s.ended_at - stopped < STREAM_BOUND, s.ended_at - stopped
    t0 = time.monotonic()
    h = c.get(f.stack, "/health", timeout=c.CONTROL_BOUND)
    assert h.status_code == 503, h.text
    assert time.monotonic() - t0 < c.CT + 5 + 2
    time.sleep(max(0.0, stopped + HELD - time.monotonic()))


def test_engine_stopped_mid_stream(faults: Faults) -> None:
    """The stream ends with the API's "no answer" error within CONTROL_TIMEOUT_S of the
    stop; /health is 503 meanwhile; after SIGCONT the engine drops the request whose
    reader left (the API's cancel, or the reply probe) instead of running it on."""
    f = faults
    stream = c.Stream(f.stack, max_tokens=1500)
    assert stream.started.wait(c.GEN_BOUND)
    pid = int(c.status(f.stack)["engine_pid"])
    c.signal_quietly(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _streams_fail_health_says_so(f, [stream], stopped, "engine")
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    _until_no_requests(f, time.monotonic(), ORPHAN_BOUND)
    st = c.wait_recovered(f.stack)
    assert st["engine_pid"] == pid and st["state"] == "running", st


def test_api_stopped_mid_stream(faults: Faults) -> None:
    """The API stopped for longer than its stream idle timeout (its NATS connection
    stays open, so the reply probe never sees no-responders and the engine goes on):
    after SIGCONT the client's stream completes, and the engine holds nothing after."""
    f = faults
    # fewer tokens than STREAM_BUFFER (256): all of them may arrive in one burst after
    # SIGCONT, and more than that unread is the documented slow-reader drop
    stream = c.Stream(f.stack, max_tokens=200)
    assert stream.started.wait(c.GEN_BOUND)
    api = c.child_pid(f.stack.proc.pid, "services.api")
    c.signal_quietly(api, signal.SIGSTOP)
    try:
        time.sleep(HELD)
    finally:
        c.signal_quietly(api, signal.SIGCONT)
    continued = time.monotonic()
    s = stream.result(c.GEN_BOUND)
    # the engine was never silent: its tokens waited in the API's socket. Before, the
    # API's idle timer ran first after SIGCONT and the client got `engine: no answer
    # for 6s (no heartbeat)` — a lie, and the request was cancelled
    assert s.outcome == "done", (s.outcome, s.error, s.tokens)
    _until_no_requests(f, continued, ORPHAN_BOUND + c.GEN_BOUND)
    c.wait_recovered(f.stack)


# commit only: its window is the one where a late call switches a rank (stage's, tried
# too, found nothing; CI time)
@pytest.mark.parametrize("phase", ["commit"])
def test_nats_stopped_during_update_weights(faults: Faults, phase: str) -> None:
    """The nats-server stopped while the ranks sit in their ``phase`` window, for longer
    than the API's bound: the call answers 503 within it; once continued, the engine's
    version is the one every rank serves and the greedy output is that version's (the
    late stage/commit the ranks get after SIGCONT is refused or rolled back)."""
    f = faults
    needle = f"rank 1: test delay before {phase}"
    before = c.log_count(f.stack, needle)
    assert c.ctl(f.stack, "/v1/pause").status_code == 200
    call = c.Call(f.stack, "/v1/update_weights", json={"version": "v1"})
    c.wait_log(f.stack, needle, before)
    assert f.nats.proc is not None
    pid = f.nats.proc.pid
    c.signal_quietly(pid, signal.SIGSTOP)
    try:
        r = call.result(c.CONTROL_BOUND)
        assert r.status_code == 503, r.text
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    continued = time.monotonic()
    # every rank hears the bus again at once (before: their read loops had died on the
    # late PONG of the commit's bus barrier, deaf for minutes)
    while not all(r["alive"] for r in c.status(f.stack, fresh=True)["ranks"]):
        assert time.monotonic() - continued < 15, c.status(f.stack)
        time.sleep(0.3)
    st = c.wait_recovered(f.stack)
    assert st["state"] in ("paused", "running"), st
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    c.assert_consistent(f.stack, str(st["weight_version"]))


def test_concurrent_control_calls_while_a_rank_is_stopped(faults: Faults) -> None:
    """Every control route at once, twice, while rank 1 is stopped: each answers within
    its stated bound (200, 409 for a mutating call behind another, 503 naming the
    silent rank); ``status?fresh=true`` answers within 2 s showing rank 1 not alive.
    Once continued, the engine's state is what every rank shows."""
    f = faults
    pid = c.rank_pid(f.stack, 1)
    c.signal_quietly(pid, signal.SIGSTOP)
    one_hop = c.CT + 5 + 2
    try:
        t0 = time.monotonic()
        st = c.status(f.stack, fresh=True)
        assert time.monotonic() - t0 < 2 + 2
        r1 = next(r for r in st["ranks"] if r["rank"] == 1)
        assert not r1["alive"], st
        calls: list[tuple[c.Call, float]] = []
        for _ in range(2):
            calls += [
                (c.Call(f.stack, "/v1/pause", params={"mode": "wait"}), one_hop),
                (c.Call(f.stack, "/v1/sleep"), c.CONTROL_BOUND),
                (c.Call(f.stack, "/v1/wakeup"), c.CONTROL_BOUND),
                (c.Call(f.stack, "/v1/update_weights", json={"version": "v2"}), c.CONTROL_BOUND),
                (c.Call(f.stack, "/v1/resume"), one_hop),
            ]
        t0 = time.monotonic()
        h = c.get(f.stack, "/health", timeout=c.CONTROL_BOUND)
        assert h.status_code == 503 and "ranks [1]" in h.text, h.text
        assert time.monotonic() - t0 < one_hop
        for call, bound in calls:
            r = call.result(bound)
            assert r.status_code in (200, 409, 503), (call.path, r.text)
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    st = c.wait_recovered(f.stack)
    want_loaded = "weight" not in st["asleep"]
    for r in st["ranks"]:
        assert r["version"] == st["weight_version"], st
        assert bool(r["weights_loaded"]) == want_loaded, st


def test_a_flush_timed_out_while_the_server_was_stopped_leaves_the_bus_reading(
    tmp_path: Path,
) -> None:
    """``Bus.flush`` (a PING/PONG: the ranks' commit barrier) times out while the
    nats-server is stopped; its PONG arrives after SIGCONT. The connection must go on
    delivering. Before: nats-py set the cancelled flush's future, the read loop died of
    ``InvalidStateError`` and the process heard nothing again — both ranks deaf, /health
    503 for minutes (test_nats_stopped_during_update_weights[commit])."""
    server = NatsProc(tmp_path / "nats", tmp_path / "nats.log")

    async def run() -> None:
        bus = await Bus.connect(server.url, "stall-test")
        got = asyncio.Event()

        async def on_msg(_: object) -> None:
            got.set()

        try:
            await bus.subscribe("stall.t", on_msg)
            await bus.flush()
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)
            try:
                wait_stopped(server.proc.pid)  # else the PONG may beat the signal
                with pytest.raises(nats.errors.FlushTimeoutError):
                    await bus.flush(1.0)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            await bus.publish("stall.t", b"x", headers={REQUEST_ID: "stall"})
            await asyncio.wait_for(got.wait(), 10)
        finally:
            await bus.close()

    try:
        asyncio.run(run())
    finally:
        server.stop()


def _engine_stopped_in(f: Faults, phase: str) -> tuple[int, c.Call]:
    """Pause, start ``update_weights`` to v1, and SIGSTOP the engine once rank 1 sits in
    its ``phase`` window (the stack's test delay): the engine's pid and the call."""
    needle = f"rank 1: test delay before {phase}"
    before = c.log_count(f.stack, needle)
    assert c.ctl(f.stack, "/v1/pause").status_code == 200
    pid = int(c.status(f.stack)["engine_pid"])
    call = c.Call(f.stack, "/v1/update_weights", json={"version": "v1"})
    c.wait_log(f.stack, needle, before)
    c.signal_quietly(pid, signal.SIGSTOP)
    return pid, call


# commit only: its window is the one where a late call switches a rank (stage's, tried
# too, found nothing; CI time)
@pytest.mark.parametrize("phase", ["commit"])
def test_engine_stopped_during_update_weights(faults: Faults, phase: str) -> None:
    """The engine stopped while the ranks sit in their ``phase`` window, until the API
    gave up (503 within its bound). Continued, the engine finds its scatter late (the
    ranks' replies wait in its socket): whatever it then does, its version is the one
    every rank serves, and the greedy output is that version's."""
    f = faults
    pid, call = _engine_stopped_in(f, phase)
    try:
        r = call.result(c.CONTROL_BOUND)
        assert r.status_code == 503 and "engine: no reply" in r.text, r.text
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    # continued, the engine ends the update it was running (its scatter found late,
    # then a rollback), bounded by its own timeouts
    continued = time.monotonic()
    while (st := c.wait_recovered(f.stack))["state"] == "updating":
        assert time.monotonic() - continued < c.CONTROL_BOUND, st
        time.sleep(0.3)
    assert st["engine_pid"] == pid and st["state"] in ("paused", "running"), st
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    c.assert_consistent(f.stack, str(st["weight_version"]))


def test_engine_stopped_past_its_commit_scatter_keeps_the_update(faults: Faults) -> None:
    """The engine stopped while the ranks sit in their commit window, for longer than
    its scatter's CONTROL_TIMEOUT_S but less than the API waits: the ranks' commit
    replies come while it is stopped and wait in its socket. Continued, its timer is due
    first; the bus settles (PING/PONG) before it blames them, so the update stands:
    200, every rank on the new version, nothing rolled back. Before: `commit: ranks
    [0, 1] did not answer within 6s; ranks that had committed were rolled back`."""
    f = faults
    rollbacks = c.log_count(f.stack, "rolling the ranks back")
    pid, call = _engine_stopped_in(f, "commit")
    try:
        wait_stopped(pid)
        # past the scatter's timer (sent before the stop), with room for the ranks'
        # commit window and replies; the API waits 2 x CT + 5 s for the whole call
        time.sleep(c.CT + 3)
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    r = call.result(c.CONTROL_BOUND)
    assert c.log_count(f.stack, "rolling the ranks back") == rollbacks, f.stack.log_tail()
    assert r.status_code == 200, r.text
    assert r.json()["result"]["version"] == "v1", r.text
    st = c.status(f.stack)
    assert st["engine_pid"] == pid and st["weight_version"] == "v1", st
    assert [x["version"] for x in st["ranks"]] == ["v1", "v1"], st
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    c.assert_consistent(f.stack, "v1")
