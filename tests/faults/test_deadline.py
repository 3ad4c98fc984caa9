"""A control call that failed for its caller never runs later.

The nats-server is SIGSTOPped while a ``pause`` is on its way: the publish sits in the
caller's socket, the caller gives up (503), then the server is SIGCONTed and delivers
the pause to the engine. It carries its caller's ``Rollbus-Deadline``, past by then: the
engine drops it, and the state the caller was told about (not paused) stays true."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from shared.bus import Bus
from shared.errors import ControlError
from shared.subjects import Subjects
from tests.faults import common as c
from tests.faults.common import Faults

pytestmark = pytest.mark.faults

DROPPED = "past its caller's deadline"
WATCH_S = 4.0  # a pause that ran would show within one step (idle engine: at once)


def _never_paused(f: Faults, seconds: float = WATCH_S) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        st = c.status(f.stack)
        assert st["state"] == "running" and not st["is_paused"], st
        time.sleep(0.1)


def _stopped(f: Faults) -> None:
    """SIGSTOP the server and wait until the kernel shows it stopped (``T``): a signal
    is delivered asynchronously, and the call must not slip through before it lands."""
    assert f.nats.proc is not None
    pid = f.nats.proc.pid
    f.nats.proc.send_signal(signal.SIGSTOP)
    end = time.monotonic() + 10
    while not all(_state(t) == "T" for t in Path(f"/proc/{pid}/task").iterdir()):
        assert time.monotonic() < end, "nats-server not stopped"
        time.sleep(0.005)


def _state(task: Path) -> str:
    """A thread's state letter from ``/proc/<pid>/task/<tid>/stat`` (after the name)."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread ended meanwhile
        return "T"


def _continued(f: Faults) -> None:
    assert f.nats.proc is not None
    f.nats.proc.send_signal(signal.SIGCONT)


def test_timed_out_nats_pause_never_runs(faults: Faults) -> None:
    """rollbus's own ``Bus.request`` (2 s timeout) to ``ctl.pause`` while the server is
    stopped: Timeout for the caller, then dropped by the engine once delivered."""
    f = faults
    before = c.log_count(f.stack, DROPPED)
    expired = c.status(f.stack)["bus"]["expired"]

    async def call() -> None:
        bus = await Bus.connect(f.nats.url, "deadline-test")
        try:
            _stopped(f)
            try:
                try:
                    rep = await bus.request(
                        Subjects(f.stack.instance).ctl("pause"), b"{}", timeout=2.0
                    )
                except ControlError as e:
                    assert e.code == 503, e.message
                    assert "within 2s" in e.message, e.message  # a plain timeout
                else:
                    raise AssertionError(f"answered while the server is stopped: {rep}")
            finally:
                _continued(f)
            await bus.flush()  # the server has now taken (and delivered) our pause
        finally:
            await bus.close()

    asyncio.run(call())
    _never_paused(f)  # what the caller was told stays true
    c.wait_log(f.stack, DROPPED, before, timeout=10)  # and the pause did reach the engine
    assert c.status(f.stack)["bus"]["expired"] > expired


def test_timed_out_http_pause_never_runs(faults: Faults) -> None:
    """The audit's case: ``POST /v1/pause`` while the server is stopped answers 503 after
    the API's timeout (CONTROL_TIMEOUT_S + 5 s); the engine is not paused afterwards."""
    f = faults
    before = c.log_count(f.stack, DROPPED)
    expired = c.status(f.stack)["bus"]["expired"]
    _stopped(f)
    try:
        call = c.Call(f.stack, "/v1/pause")
        r = call.result(c.CONTROL_BOUND)
        assert r.status_code == 503, r.text
    finally:
        _continued(f)
    _never_paused(f)  # what the caller was told stays true
    c.wait_log(f.stack, DROPPED, before, timeout=10)  # and the pause did reach the engine
    assert c.status(f.stack)["bus"]["expired"] > expired
