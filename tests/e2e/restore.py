"""Put a shared stack back as a failed test found it, so that one failure reports one.

A module's stack (or the session's) outlives each test. A test that fails half-way can
leave it paused, asleep, on another version or with a rank SIGSTOPped; the next test on
it would then fail for that alone (CI of 3d65b0c's parent: test_late_commit_is_refused
failed only because test_late_wakeup left the stack asleep). ``tests/conftest.py``
records each stack's state before a test's call and, when the call failed, runs
:func:`restore`: SIGCONT to every process of the stack, wait until it answers, wakeup /
update_weights / pause, resume or sleep (with its tags) back to the recorded state, and a
restart in place when that does not work (a pytest warning names the stack and what it
took). A test that passes is never touched.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx

from tests.e2e.procs import descendants
from tests.e2e.stack import Stack

State = tuple[str, str, str]  # (state, weight_version, the asleep tags joined by ",")
# the states a stack can be put back to (an "updating" one has no call that returns to it)
STEADY = ("running", "paused", "sleeping")


def stacks_of(funcargs: dict[str, Any]) -> list[Stack]:
    """The stacks among a test's fixture values: a ``Stack``, an object holding one as
    ``.stack`` (the fault tests' ``Faults``), or a tuple with one (``(server, stack)``)."""
    out: list[Stack] = []
    for v in funcargs.values():
        for x in v if isinstance(v, tuple) else (v,):
            try:
                s = x if isinstance(x, Stack) else getattr(x, "stack", None)
            except Exception:  # noqa: BLE001 - any fixture value: a property may raise
                continue
            if isinstance(s, Stack) and s not in out:
                out.append(s)
    return out


def snapshot(stack: Stack) -> State | None:
    """The stack's (state, weight_version, asleep tags) now; None when it does not answer
    or is between states (nothing to restore to)."""
    if stack.proc.poll() is not None:
        return None
    try:
        with stack.client(timeout=10) as c:
            r = c.get("/v1/status")
        if r.status_code != 200:
            return None
        st = r.json()
        if st["state"] not in STEADY:
            return None
        return str(st["state"]), str(st["weight_version"]), ",".join(sorted(st.get("asleep") or []))
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def _continue_all(stack: Stack) -> None:
    """SIGCONT to the launcher and every process under it (a failed test may have left a
    rank, the engine or the API stopped)."""
    for pid in [stack.proc.pid, *descendants(stack.proc.pid)]:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _answering(stack: Stack, timeout: float) -> dict[str, Any] | None:
    """Status once /health is 200 and every rank answers on one version, else None."""
    deadline = time.monotonic() + timeout
    with stack.client(timeout=10) as c:
        while time.monotonic() < deadline:
            if stack.proc.poll() is not None:
                return None
            try:
                if c.get("/health").status_code == 200:
                    st = dict(c.get("/v1/status", params={"fresh": "true"}).json())
                    ranks = st.get("ranks", [])
                    if all(r.get("alive") for r in ranks) and {r.get("version") for r in ranks} == {
                        st.get("weight_version")
                    }:
                        return st
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
    return None


def _put_back(stack: Stack, found: State, timeout: float) -> bool:
    state, version, asleep = found
    st = _answering(stack, timeout)
    if st is None:
        return False
    # generous: an update may have to wait out a control call the failed test left running
    with stack.client(timeout=120) as c:
        if st["state"] == "sleeping":
            c.post("/v1/wakeup")
        now = snapshot(stack)
        if now is not None and now[1] != version:
            c.post("/v1/pause")
            c.post("/v1/update_weights", json={"version": version})
        if state == "running":
            c.post("/v1/resume")
        elif state == "paused":
            c.post("/v1/pause")
        elif state == "sleeping":  # as asleep as it was (a test may start on a sleeping stack)
            c.post("/v1/sleep", json={"tags": asleep.split(",")} if asleep else None)
    return _answering(stack, 30) is not None and snapshot(stack) == found


def restore(stack: Stack, found: State, timeout: float = 90) -> str:
    """Bring ``stack`` back to ``found``; what it took ("" when nothing differed). Raises
    when even a restart does not."""
    _continue_all(stack)
    # one wait for the stack's own recovery (it waited twice when it never came: with the
    # restart, past pytest-timeout's 300 s for the test and its teardown together)
    answering = _answering(stack, timeout) is not None
    if answering and snapshot(stack) == found:
        return ""
    if answering and _put_back(stack, found, 10):
        return "put back"
    stack.restart()
    if _put_back(stack, found, 60):
        return "restarted"
    raise AssertionError(f"the shared stack cannot be brought back to {found}:\n{stack.log_tail()}")
