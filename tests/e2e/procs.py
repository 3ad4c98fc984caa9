"""A process and the processes under it, read from /proc (tests that check nothing of a
stack is left running, or signal all of it)."""

from __future__ import annotations

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
