"""Real rank processes for tests that run paddle ranks without a stack: each in its own
session (a kill takes any helper paddle started with it), its output in its log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def rank_processes(
    runs: list[tuple[list[str], dict[str, str], Path]], cwd: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start one process per ``(argv, env, log)``; on leaving, SIGKILL any still running."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv, env, log in runs:
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        argv,
                        cwd=cwd,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_ok(
    procs: list[subprocess.Popen[bytes]], logs: list[Path], deadline: float, tail: int = 3000
) -> list[str]:
    """Each process's log tail, once every one exited 0 by ``deadline`` (monotonic); else
    an AssertionError naming the rank and its log tail."""
    tails = []
    for r, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        text = logs[r].read_text(errors="replace")[-tail:]
        assert code == 0, f"rank {r} exit {code}:\n{text}"
        tails.append(text)
    return tails
