"""The put-back of a failed test's shared stack (tests/e2e/restore.py), on the session's
stack: each case changes the stack as a failed test may leave it, then :func:`restore`
must bring it back to the recorded state with control calls alone ("put back"; a
restart would hide that the stack did not recover, and costs a start)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.tiny_model import write_version
from tests.e2e.restore import restore, snapshot
from tests.e2e.stack import Stack


@pytest.fixture(autouse=True)
def running_awake(stack: Stack) -> Iterator[None]:
    yield
    with stack.client() as c:
        if stack.status()["state"] == "sleeping":
            c.post("/v1/wakeup")
        c.post("/v1/resume")


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_paused_stack_on_another_version_is_put_back(stack: Stack) -> None:
    found = snapshot(stack)
    assert found is not None and found[0] == "running", found
    write_version(stack.model_dir, "restore-v1", seed=7)
    with stack.client() as c:
        assert c.post("/v1/pause").status_code == 200
        r = c.post("/v1/update_weights", json={"version": "restore-v1"})
        assert r.status_code == 200, r.text
    assert restore(stack, found, timeout=30) == "put back"
    assert snapshot(stack) == found


def test_a_stopped_rank_is_continued_without_a_restart(stack: Stack) -> None:
    found = snapshot(stack)
    assert found is not None
    pid = next(r["pid"] for r in stack.status()["ranks"] if r["rank"] == 1)
    launcher = stack.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert restore(stack, found, timeout=30) in ("", "put back")
        assert _proc_state(pid) != "T" and stack.proc.pid == launcher  # continued, in place
    finally:  # gone when a restart replaced it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_sleeping_stack_is_put_back_asleep(stack: Stack) -> None:
    """A test may start on a sleeping stack (and wake it before it fails)."""
    with stack.client() as c:
        assert c.post("/v1/sleep", json={"tags": ["kv_cache"]}).status_code == 200
    found = snapshot(stack)
    assert found is not None and found[0] == "sleeping" and found[2] == "kv_cache", found
    with stack.client() as c:
        assert c.post("/v1/wakeup").status_code == 200
    assert restore(stack, found, timeout=30) == "put back"
    assert snapshot(stack) == found
