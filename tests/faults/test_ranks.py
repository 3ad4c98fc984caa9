"""A worker rank SIGKILLed or SIGSTOPped during stage, during commit and during
generation: the call answers in bounded time naming the rank, no rank serves a version
alone (per-rank versions, greedy output = the version's reference), and the stack
recovers by itself (the launcher restarts killed ranks; the engine brings them back to
its version)."""

from __future__ import annotations

import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.tiny_model import write_version
from tests.faults import common as c
from tests.faults.common import Faults

pytestmark = pytest.mark.faults


def _update_until(f: Faults, version: str, phase: str, rank: int = 1) -> c.Call:
    """Start ``update_weights(version)`` (engine paused first) and return once ``rank``
    sits in the test window before ``phase``."""
    needle = f"rank {rank}: test delay before {phase}"
    before = c.log_count(f.stack, needle)
    assert c.ctl(f.stack, "/v1/pause").status_code == 200
    call = c.Call(f.stack, "/v1/update_weights", json={"version": version})
    c.wait_log(f.stack, needle, before)
    return call


def _assert_failed_naming_rank(call: c.Call, method: str, bound: float) -> None:
    """503 naming ``method`` and rank 1 (a SIGKILL makes the launcher restart every
    rank at once, so rank 0 may be named too)."""
    r = call.result(bound)
    assert r.status_code == 503, r.text
    msg = r.json()["error_message"]
    named = re.search(r"ranks \[([\d, ]+)\] did not answer", msg)
    assert msg.startswith(method) and named and "1" in named.group(1).split(", "), msg


# ---------------------------------------------------------------- during stage


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=c.sig_name)
def test_rank_fault_during_stage_changes_nothing(faults: Faults, sig: int) -> None:
    f = faults
    pid = c.rank_pid(f.stack, 1)
    call = _update_until(f, "v1", "stage")
    c.signal_quietly(pid, sig)
    try:
        # stage scatter: one control timeout (plus the test window) and a clear 503
        _assert_failed_naming_rank(call, "stage", c.CT + 2 * c.DELAY + c.MARGIN)
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    if sig == signal.SIGKILL:
        # the launcher restarted every rank: new pids
        st = c.wait_recovered(f.stack)
        assert pid not in [r["pid"] for r in st["ranks"]]
    time.sleep(c.DELAY + 1)  # a stopped rank finishes its stale stage; abort drops it
    st = c.wait_recovered(f.stack)
    assert st["state"] == "paused" and st["weight_version"] == "v0", st
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    c.assert_consistent(f.stack, "v0")
    # and the same version applies cleanly afterwards
    assert c.ctl(f.stack, "/v1/pause").status_code == 200
    r = c.ctl(f.stack, "/v1/update_weights", json={"version": "v1"})
    assert r.status_code == 200, r.text
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    c.assert_consistent(f.stack, "v1")


# ---------------------------------------------------------------- during commit


def test_rank_stopped_during_commit_rolls_back_and_refuses_late_commit(faults: Faults) -> None:
    """Rank 0 commits, rank 1 is stopped inside its commit window: the engine times out,
    rolls rank 0 back, and rank 1's late commit (it runs after SIGCONT) is refused."""
    f = faults
    pid = c.rank_pid(f.stack, 1)
    call = _update_until(f, "v1", "commit")
    c.signal_quietly(pid, signal.SIGSTOP)
    try:
        _assert_failed_naming_rank(call, "commit", 2 * c.DELAY + c.CT + c.MARGIN)
        msg = call.response.json()["error_message"] if call.response else ""
        assert "rolled back to 'v0'" in msg, msg
        # rank 0 had switched; the rollback (a broadcast) puts it back on v0 while rank 1
        # is still stopped
        deadline = time.monotonic() + 5
        while True:
            st = c.status(f.stack)
            live = [r.get("version") for r in st["ranks"] if r.get("alive")]
            if live == ["v0"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert st["weight_version"] == "v0" and live == ["v0"], st
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    # rank 1 now runs its late commit: refused, it stays on v0 (watched past the window)
    deadline = time.monotonic() + c.DELAY + 3
    while time.monotonic() < deadline:
        st = c.status(f.stack)
        assert {r.get("version") for r in st["ranks"] if r.get("alive")} <= {"v0"}, st
        time.sleep(0.2)
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    c.assert_consistent(f.stack, "v0")


def test_rank_killed_during_commit_recovers_on_the_old_version(faults: Faults) -> None:
    f = faults
    pid = c.rank_pid(f.stack, 1)
    call = _update_until(f, "v1", "commit")
    c.signal_quietly(pid, signal.SIGKILL)
    _assert_failed_naming_rank(call, "commit", 2 * c.DELAY + c.CT + c.MARGIN)
    st = c.wait_recovered(f.stack)
    assert pid not in [r["pid"] for r in st["ranks"]]
    assert st["state"] == "paused" and st["weight_version"] == "v0", st
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    c.assert_consistent(f.stack, "v0")


# ---------------------------------------------------------------- during generation


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=c.sig_name)
def test_rank_fault_during_generation(faults: Faults, sig: int) -> None:
    """Serving v1 (not the model dir's version): the stream ends with an error naming the
    failed step; killed ranks come back on v0 from disk and the engine brings them to v1
    before anything is served."""
    f = faults
    assert c.ctl(f.stack, "/v1/pause").status_code == 200
    assert c.ctl(f.stack, "/v1/update_weights", json={"version": "v1"}).status_code == 200
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    pid = c.rank_pid(f.stack, 1)
    stream = c.Stream(f.stack)
    assert stream.started.wait(c.GEN_BOUND)
    assert stream.outcome == "", (stream.outcome, stream.error)  # still streaming
    c.signal_quietly(pid, sig)
    try:
        s = stream.result()
        assert s.outcome == "error", (s.outcome, s.error, s.tokens)
        assert "step" in str(s.error) and "rank" in str(s.error), s.error
        if sig == signal.SIGSTOP:  # rank 0 waits for its peer: the silent rank is named
            assert "ranks [1] not answering" in str(s.error), s.error
        # while a rank is stopped or the ranks restart, /health says so
        deadline = time.monotonic() + 10
        while c.get(f.stack, "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 with a rank down"
            time.sleep(0.2)
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    st = c.wait_recovered(f.stack)
    if sig == signal.SIGKILL:
        assert pid not in [r["pid"] for r in st["ranks"]]
    c.assert_consistent(f.stack, "v1")


def test_rank_killed_while_steps_are_pipelined(faults: Faults) -> None:
    """Four streams in one pipelined batch (arrived one by one), rank 0 killed: every
    stream ends with an error naming the step and the rank (gone) within CONTROL_TIMEOUT_S
    of the kill; a pause right after answers within its bound (the step sent behind the
    failed one is settled, not waited for past its bound); once recovered, a batch of
    concurrent greedy requests answers the reference tokens exactly."""
    f = faults
    pid = c.rank_pid(f.stack, 0)
    streams = []
    for _ in range(4):
        streams.append(c.Stream(f.stack))
        assert streams[-1].started.wait(c.GEN_BOUND)
    time.sleep(0.5)
    assert all(s.outcome == "" for s in streams), [(s.outcome, s.error) for s in streams]
    killed = time.monotonic()
    c.signal_quietly(pid, signal.SIGKILL)
    for s in streams:
        s.result()
        assert s.outcome == "error", (s.outcome, s.error, s.tokens)
        assert "step" in str(s.error) and "rank" in str(s.error), s.error
        # failed once the rank is seen gone (rank 1 too once the launcher restarts all
        # ranks), not when CONTROL_TIMEOUT_S ran out
        assert re.search(r"ranks \[0(, 1)?\] gone", str(s.error)), s.error
        assert s.ended_at - killed <= c.CT + c.MARGIN, (s.ended_at - killed, s.error)
    r = c.Call(f.stack, "/v1/pause", params={"mode": "abort"}).result(c.CONTROL_BOUND)
    assert r.status_code == 200, r.text
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    st = c.wait_recovered(f.stack)
    assert pid not in [r["pid"] for r in st["ranks"]]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: c.greedy_tokens(f.stack), range(4)))
    ref = c.reference(f.stack, "v0")
    for out in outs:
        assert out is not None and out[1] == ref and out[0] in ("", "v0"), (out, ref)


def test_ranks_restarted_after_the_engine_version_was_deleted(faults: Faults) -> None:
    """The engine serves v2, v2's files are deleted, then a rank dies: the restarted ranks
    cannot load v2, so the engine takes their version (v0) — logged, evented and labelled
    truthfully — instead of never being ready again."""
    f = faults
    assert c.ctl(f.stack, "/v1/pause").status_code == 200
    assert c.ctl(f.stack, "/v1/update_weights", json={"version": "v2"}).status_code == 200
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    v2 = f.stack.model_dir / "versions" / "v2"
    shutil.rmtree(v2)
    try:
        pid = c.rank_pid(f.stack, 0)
        c.signal_quietly(pid, signal.SIGKILL)
        st = c.wait_recovered(f.stack)
        assert pid not in [r["pid"] for r in st["ranks"]]
        assert "version 'v2' cannot be loaded" in f.stack.log.read_text()
        c.assert_consistent(f.stack, "v0")
    finally:
        write_version(f.stack.model_dir, "v2", seed=2)


def test_killed_rank_is_seen_at_once(faults: Faults) -> None:
    """A killed rank shares the engine's pid space: /health and /v1/status say so at
    once (not after the status bound), before the launcher (stopped here, so the rank
    stays a zombie) has even restarted anything; then it recovers by itself."""
    f = faults
    pid = c.rank_pid(f.stack, 1)
    c.signal_quietly(f.stack.proc.pid, signal.SIGSTOP)
    try:
        c.signal_quietly(pid, signal.SIGKILL)
        c.wait_exited(pid)  # the kill itself takes a moment; "at once" counts from the exit
        r = c.get(f.stack, "/health")
        assert r.status_code == 503 and f"its process {pid} has exited" in r.text, r.text
        rank1 = c.status(f.stack)["ranks"][1]
        assert not rank1["alive"] and "has exited" in rank1["reason"], rank1
    finally:
        c.signal_quietly(f.stack.proc.pid, signal.SIGCONT)
    st = c.wait_recovered(f.stack)
    assert pid not in [r["pid"] for r in st["ranks"]]
