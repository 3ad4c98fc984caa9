"""``rollbus serve`` as a child process, for programs that start an instance of their own
(``examples/async_grpo``, the e2e tests): a clean ``ROLLBUS_*`` environment, the start,
the wait for ``/health`` and the stop (SIGTERM, SIGKILL past the timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.launcher import free_port

__all__ = ["free_port", "serve_env", "spawn", "stop", "wait_healthy"]


def serve_env(**settings: str) -> dict[str, str]:
    """This process's environment without its ``ROLLBUS_*`` variables, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    env.update(settings)
    return env


def spawn(
    env: dict[str, str],
    log: Path,
    cwd: Path | None = None,
    *,
    append: bool = False,
    start_new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """``python -m services.cli serve`` with ``env``, stdout and stderr into ``log``
    (truncated, or appended to); ``start_new_session``: in a process group of its own, as
    a shell starts a foreground job."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=cwd,
        env=env,
        stdout=open(log, "ab" if append else "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=start_new_session,
    )


def wait_healthy(
    base_url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120
) -> None:
    """Until ``GET /health`` answers 200; RuntimeError (with the log's tail) when ``proc``
    exits first or ``timeout`` passes. Leaves ``proc`` running either way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:]
            raise RuntimeError(f"rollbus serve exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"rollbus serve not healthy in {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM (the launcher's ordered stop), SIGKILL past ``timeout``; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)
