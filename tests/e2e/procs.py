"""A process and the processes under it, read from /proc (tests that check nothing of a
stack is left running, or signal all of it)."""

from __future__ import annotations

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """False once ``pid`` exited (a zombie not yet reaped counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> set[int]:
    """Every process under ``pid`` (children of any of its threads, and theirs)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                kids = {int(x) for x in (t / "children").read_text().split()}
            except OSError:
                continue
            todo += list(kids - out)
            out |= kids
    return out


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of ``pid`` shows state ``T`` (a signal lands asynchronously)."""
    end = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # the thread ended meanwhile
                pass
        if states and all(st == "T" for st in states):
            return
        assert time.monotonic() < end, f"process {pid} not stopped"
        time.sleep(0.005)
