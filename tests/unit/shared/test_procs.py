"""``shared.procs.gone``: whether a reported rank process has exited, asked on every
``status`` for every rank. A pidfd polled (no /proc read per call), dropped once its
process exits; ``/proc/<pid>/stat`` where pidfds are not available. Real processes,
real signals."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from shared import procs


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    procs.forget()
    procs._no_pidfd = False
    yield
    procs.forget()
    procs._no_pidfd = False


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "600"])  # noqa: S607


def _zombie(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``p`` and wait until it is a zombie (not reaped: its parent is us)."""
    p.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError("no zombie")


def test_a_running_process_is_not_gone_and_its_pidfd_is_kept() -> None:
    p = _child()
    try:
        assert procs.gone(p.pid) is False
        assert procs.gone(p.pid) is False  # asked again: the same pidfd, polled
        assert p.pid in procs._pidfds
    finally:
        p.kill()
        p.wait()


def test_a_killed_process_is_gone_at_once_zombie_or_reaped_and_its_pidfd_closed() -> None:
    p = _child()
    try:
        assert procs.gone(p.pid) is False
        fd = procs._pidfds[p.pid]
        _zombie(p)  # not reaped yet: still in /proc, but exited
        assert procs.gone(p.pid) is True
        assert p.pid not in procs._pidfds  # the pid may be reused: never kept past exit
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
        assert procs.gone(p.pid) is True  # a zombie asked anew
        p.wait()
        assert procs.gone(p.pid) is True  # reaped: no such process
        assert p.pid not in procs._pidfds
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_without_pidfds_proc_is_read_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    def nosys(pid: int) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open")

    monkeypatch.setattr(os, "pidfd_open", nosys)
    p = _child()
    try:
        assert procs.gone(p.pid) is False and procs._no_pidfd and not procs._pidfds
        _zombie(p)
        assert procs.gone(p.pid) is True
    finally:
        p.kill()
        p.wait()
    assert procs.gone(p.pid) is True


def test_a_transient_pidfd_error_falls_back_once_only(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pidfd_open
    calls = []

    def emfile_once(pid: int) -> int:
        calls.append(pid)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "too many open files")
        return real(pid)

    monkeypatch.setattr(os, "pidfd_open", emfile_once)
    p = _child()
    try:
        assert procs.gone(p.pid) is False  # through /proc this time
        assert not procs._no_pidfd and not procs._pidfds
        assert procs.gone(p.pid) is False and p.pid in procs._pidfds  # a pidfd again
    finally:
        p.kill()
        p.wait()


def test_held_pidfds_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_PIDFD_LIMIT", 2)
    ps = [_child() for _ in range(3)]
    try:
        for p in ps:
            assert procs.gone(p.pid) is False
        assert len(procs._pidfds) <= 2 and ps[2].pid in procs._pidfds
        assert [procs.gone(p.pid) for p in ps] == [False, False, False]
    finally:
        for p in ps:
            p.kill()
            p.wait()
