"""A rank call the engine gave up on is never applied later behind its back.

A rank is SIGSTOPped while the engine scatters a call to every rank; the engine times
out, tells its caller (503) and undoes the call on the others. The rank stays stopped
long enough for the nats-server to cut it off (this module's server pings every 1 s and
closes a client after 3 missed pings; the default, 2 min, makes that ~4-6 min): what
the engine sent it meanwhile — the undo — is lost, while the call itself, already in the
rank's socket, arrives once it is SIGCONTed. The rank must not run it (its
``Rollbus-Deadline`` has passed), and the engine brings every rank back to its state once
all answer. The stack runs with ``SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE``, so a wakeup
rebuilds the comm group: a collective, which every rank must run alike."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.tiny_model import write_version
from tests.e2e.stack import Stack, free_port
from tests.faults import common as c
from tests.faults.common import NatsProc

pytestmark = pytest.mark.faults

PING = 'ping_interval: "1s"\nping_max: 3\n'
CUT_S = 10.0  # a stopped rank is cut off well within this (3 missed pings 1 s apart)
MONITOR: dict[str, int] = {}  # the module server's monitoring port ("port")
ASLEEP = {"weights_loaded": False, "kv_allocated": False, "comm_group": False}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("late_rank_calls"))
    MONITOR["port"] = free_port()  # /connz: when the server has cut a rank off
    monitor = f'http: "127.0.0.1:{MONITOR["port"]}"\n'
    nats = NatsProc(tmp / "nats", tmp / "nats.log", conf=PING + monitor)
    s = c.fault_stack(tmp, nats, ROLLBUS_SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE="true")
    try:  # the check inside: a failed one must still stop the stack and its server
        write_version(s.model_dir, "v1", seed=1)
        assert _connections(1), "rank 1's connection not seen in /connz: the cut-off wait is blind"
        yield s
    finally:
        for pid in c.rank_pids(s, quiet=True):
            c.signal_quietly(pid, signal.SIGCONT)
        s.stop()
        nats.stop()


def _connz(rank: int, state: str = "open") -> dict[int, str]:
    """The rank's connections to the module's server (its bus and, once it pulled, its
    object-store reader) in ``state``, from the server's own monitoring: cid -> the
    reason it was closed ("" while open)."""
    r = httpx.get(
        f"http://127.0.0.1:{MONITOR['port']}/connz",
        params={"limit": 4096, "state": state},
        timeout=10,
    )
    names = (f"rollbus-worker-{rank}", f"rollbus-pull-{rank}")
    conns = r.json().get("connections") or []
    return {int(x["cid"]): str(x.get("reason", "")) for x in conns if x.get("name") in names}


def _connections(rank: int) -> list[int]:
    return list(_connz(rank))


def _cut_off(since: float, cids: list[int], rank: int = 1) -> None:
    """Keep the rank stopped until the server has closed its connections ``cids`` (open
    before it was stopped) as stale: 3 missed pings 1 s apart, ~3-4 s (it waited a fixed
    CUT_S before, 6 s more than needed when quiet). Closed for any other reason, or not
    at all, the test would not test a cut-off rank: it fails."""
    assert cids, f"rank {rank} had no connection to cut off: the wait would be blind"
    while _connections(rank):  # every one of them, any opened since too
        assert time.monotonic() < since + CUT_S + 30, f"rank {rank} never cut off"
        time.sleep(0.2)
    closed = _connz(rank, "closed")
    assert all(closed.get(cid) == "Stale Connection" for cid in cids), (cids, closed)


def _call_while_cut_off(stack: Stack, path: str, says: str) -> int:
    """Rank 1 stopped and kept so until the server has surely cut it off, then ``path``
    called: it answers 503 naming ``says`` (the rank never got the call). Rank 1 is
    SIGCONTed whatever happened; its pid is returned."""
    pid = c.rank_pid(stack, 1)
    t0, cids = time.monotonic(), _connections(1)
    c.signal_quietly(pid, signal.SIGSTOP)
    try:
        _cut_off(t0, cids)
        r = c.ctl(stack, path)
        assert r.status_code == 503 and says in r.text, r.text
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    return pid


def _lock_free_while_rank_0_is_stuck(stack: Stack, until: float) -> None:
    """Until ``until`` (or 8 s at most) from the moment both ranks answer ``status`` again
    while rank 0's compute thread is still in the wakeup's barrier: every control call
    takes the control lock at once (not 409 "another control operation is in
    progress"), and ``/health`` says what the engine waits for."""
    while True:
        ranks = c.status(stack, fresh=True)["ranks"]
        if all(r.get("alive") for r in ranks) and ranks[0].get("busy") == "wakeup":
            break
        assert time.monotonic() < until, f"rank 1 never answered again: {ranks}"
        time.sleep(0.2)
    end, calls = min(until, time.monotonic() + 8), 0
    while time.monotonic() < end:
        r = c.ctl(stack, "/v1/pause", timeout=c.CT)
        assert r.status_code == 200, r.text
        calls += 1
        time.sleep(0.2)
    assert calls >= 5, calls  # the window was long enough to tell
    h = c.get(stack, "/health")
    assert h.status_code == 503 and "rank 0's compute thread has run wakeup" in h.text, h.text


def _ranks_settle(stack: Stack, want: dict[str, object], hold: float = 3.0) -> None:
    """Every rank alive and showing ``want``, then still so for ``hold`` seconds (a late
    call the rank ran afterwards would show)."""

    def shows(r: dict[str, object]) -> bool:
        return all(r.get(k) == v for k, v in want.items())

    deadline = time.monotonic() + 60
    while True:
        st = c.status(stack, fresh=True)
        if all(r.get("alive") and shows(r) for r in st["ranks"]):
            break
        assert time.monotonic() < deadline, f"ranks never showed {want}: {st}\n{stack.log_tail()}"
        time.sleep(0.2)
    end = time.monotonic() + hold
    while time.monotonic() < end:
        st = c.status(stack, fresh=True)
        assert all(shows(r) for r in st["ranks"]), (want, st)
        time.sleep(0.2)


def test_late_wakeup_is_not_run_and_the_ranks_stay_alike(stack: Stack) -> None:
    """Sleeping (comm group destroyed); rank 1 stopped and cut off during a wakeup. Rank 0
    waits for it in the comm group's barrier; the engine times out and sends both the
    sleep that undoes the wakeup — lost for rank 1. SIGCONT: both leave the barrier past
    the deadline and skip the weights and KV cache; rank 1 still has the comm group rank
    0 then destroyed, until the engine brings it back to its state. Without that, the
    next wakeup hung in rank 0's barrier; without the deadline, rank 1 woke up alone."""
    refused = "rank 1: wakeup not run"
    before = c.log_count(stack, refused)
    assert c.ctl(stack, "/v1/sleep").status_code == 200
    pid = c.rank_pid(stack, 1)
    t0, cids = time.monotonic(), _connections(1)
    c.signal_quietly(pid, signal.SIGSTOP)
    try:
        r = c.ctl(stack, "/v1/wakeup")
        assert r.status_code == 503 and "did not answer" in r.text, r.text
        _cut_off(t0, cids)
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    c.wait_log(stack, refused, before)
    _ranks_settle(stack, {"version": "v0", **ASLEEP})
    st = c.status(stack)
    assert st["state"] == "sleeping" and st["asleep"] == ["kv_cache", "weight"], st
    r = c.ctl(stack, "/v1/wakeup", timeout=c.CONTROL_BOUND)
    assert r.status_code == 200, r.text
    c.assert_consistent(stack, "v0")


def test_late_commit_is_refused(stack: Stack) -> None:
    """Rank 1 stopped in its commit window and cut off: the engine rolls rank 0 back;
    the rollback never reaches rank 1, whose commit then comes past its deadline and is
    refused. Without that it switched to v1 alone (every step then failed)."""
    refused = "rank 1: commit not run"
    before = c.log_count(stack, refused)
    assert c.ctl(stack, "/v1/pause").status_code == 200
    window = "rank 1: test delay before commit"
    opened = c.log_count(stack, window)
    pid = c.rank_pid(stack, 1)
    call = c.Call(stack, "/v1/update_weights", json={"version": "v1"})
    c.wait_log(stack, window, opened)
    t0, cids = time.monotonic(), _connections(1)
    c.signal_quietly(pid, signal.SIGSTOP)
    try:
        r = call.result(c.CONTROL_BOUND)
        assert r.status_code == 503, r.text
        assert "commit: ranks [1] did not answer" in r.text and "rolled back to 'v0'" in r.text
        _cut_off(t0, cids)
    finally:
        c.signal_quietly(pid, signal.SIGCONT)
    c.wait_log(stack, refused, before)
    _ranks_settle(stack, {"version": "v0"}, hold=c.DELAY + 2)
    st = c.status(stack)
    assert st["state"] == "paused" and st["weight_version"] == "v0", st
    assert c.ctl(stack, "/v1/resume").status_code == 200
    c.assert_consistent(stack, "v0")


def test_sleep_a_cut_off_rank_never_got_is_applied_once_it_answers(stack: Stack) -> None:
    """Rank 1 stopped and cut off before the sleep is sent: it never gets it (the
    server dropped its connection). The engine records sleeping, answers 503, and brings
    rank 1 to that state once it answers again. Without that, rank 1 kept its weights,
    KV cache and comm group while ``status`` said sleeping with no problem, and (comm
    groups unlike) the next wakeup hung in rank 0's barrier."""
    _call_while_cut_off(stack, "/v1/sleep", "sleep: ranks [1] did not answer")
    _ranks_settle(stack, {"version": "v0", **ASLEEP})
    assert c.status(stack)["state"] == "sleeping"
    r = c.ctl(stack, "/v1/wakeup", timeout=c.CONTROL_BOUND)
    assert r.status_code == 200, r.text
    c.assert_consistent(stack, "v0")


def test_wakeup_a_cut_off_rank_never_got_does_not_hold_its_peer_for_good(stack: Stack) -> None:
    """Sleeping (comm group destroyed); rank 1 stopped and cut off before the wakeup is
    sent: it never gets it, and rank 0 waits for it in the comm group's barrier, which
    nothing can interrupt (gloo's own timeout is 30 min). Past max(4 x STALL_S, 4 x
    CONTROL_TIMEOUT_S) rank 0 leaves (code 4, a line naming the rebuild), the launcher
    restarts the ranks and the engine brings them to its state: asleep. Meanwhile (rank
    1 answers again, rank 0's compute thread blocked) the engine waits for rank 0 to be
    free before it brings the ranks back: its reconcile does not hold the control lock
    on a ``drain`` rank 0 cannot answer (it held it CONTROL_TIMEOUT_S a round, again and
    again: every control call was refused with 409)."""
    left = "blocked in the comm group's rebuild"
    before = c.log_count(stack, left)
    assert c.ctl(stack, "/v1/sleep").status_code == 200
    pid = _call_while_cut_off(stack, "/v1/wakeup", "did not answer")
    # rank 0 entered the barrier when the wakeup came, CT before its 503; it leaves
    # 4 x CT after that
    _lock_free_while_rank_0_is_stuck(stack, until=time.monotonic() + 3 * c.CT - 2)
    c.wait_log(stack, left, before, timeout=4 * c.CT + 30)
    st = c.wait_recovered(stack)
    assert pid not in [r["pid"] for r in st["ranks"]], st  # restarted
    _ranks_settle(stack, {"version": "v0", **ASLEEP})
    assert c.status(stack)["state"] == "sleeping"
    r = c.ctl(stack, "/v1/wakeup", timeout=c.CONTROL_BOUND)
    assert r.status_code == 200, r.text
    c.assert_consistent(stack, "v0")
