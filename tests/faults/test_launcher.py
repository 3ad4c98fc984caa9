"""``rollbus serve`` with its embedded nats-server (authentication and per-role
permissions on): the launcher restarts a dead nats-server (same port, same store, same
config), API and engine (which comes back in its state); over the restart budget
(``ROLLBUS_RESTART_LIMIT``, 1 here) it stops the stack, naming the process. A process
killed right after the first ``/health`` 200, before the launcher's own probe saw it, is
restarted too (the API tells the launcher of its first 200)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from services.serveproc import serve_env, spawn
from services.serveproc import stop as stop_serve
from services.worker.shmreduce import default_root, segment_dir
from tests.e2e.stack import Stack, free_port, start_stack
from tests.faults import common as c

pytestmark = pytest.mark.faults


def _plant_segment(launcher: int) -> Path:
    """A shared-memory segment file of the running rank set, as a rank killed before its
    peers mapped it leaves it (``services.worker.shmreduce``)."""
    cmd = Path(f"/proc/{c.child_pid(launcher, 'services.worker --rank 1')}/cmdline").read_bytes()
    args = cmd.decode().split("\0")
    d = segment_dir(default_root(), args[args.index("--endpoints") + 1])
    d.mkdir(mode=0o700, exist_ok=True)
    (d / "rank9").write_bytes(b"\0" * 64)
    return d


def test_killed_right_after_the_first_200_is_restarted(tmp_path: Path) -> None:
    """The launcher is stopped (SIGSTOP) from the API's first answer on, so its own
    /health probe can never see the 200 a client saw; nats-server is killed right after
    that 200. The stack was ready: the launcher restarts it instead of stopping."""
    api = free_port()
    env = serve_env(
        ROLLBUS_API_PORT=str(api),
        ROLLBUS_NATS_PORT=str(free_port()),
        ROLLBUS_DATA_DIR=str(tmp_path / "data"),
        ROLLBUS_TP="1",
        ROLLBUS_LOG_LEVEL="warning",
    )
    log = tmp_path / "serve.log"
    proc = spawn(env, log)
    base = f"http://127.0.0.1:{api}"
    stopped = False
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                code = httpx.get(base + "/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if not stopped:  # every child is running once the API answers
                c.signal_quietly(proc.pid, signal.SIGSTOP)
                stopped = True
            if code == 200:
                break
            time.sleep(0.05)
        c.signal_quietly(c.child_pid(proc.pid, "nats-server"), signal.SIGKILL)
        time.sleep(0.5)
        c.signal_quietly(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while "rollbus: ready:" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "nats-server exited with code -9; restarting it" in log.read_text()
        stack = Stack(proc, base, "default", tmp_path / "data" / "models" / "tiny", "", log)
        c.assert_consistent(stack, "v0")
    finally:
        c.signal_quietly(proc.pid, signal.SIGCONT)
        stop_serve(proc)


def test_launcher_restarts_children_then_stops_over_budget(tmp_path: Path) -> None:
    stack = start_stack(
        tmp_path,
        None,  # embedded nats-server
        tp=2,
        env={"ROLLBUS_NATS_PORT": str(free_port()), "ROLLBUS_RESTART_LIMIT": "1"},
    )
    try:
        c.wait_log(stack, "rollbus: ready:", 0)  # the launcher saw it ready: restarts apply
        pid = stack.proc.pid
        for what, pattern in (("nats-server", "nats-server"), ("api", "services.api")):
            old = c.child_pid(pid, pattern)
            c.signal_quietly(old, signal.SIGKILL)
            c.wait_recovered(stack)
            assert c.child_pid(pid, pattern) != old
            assert f"{what} exited with code -9; restarting it" in stack.log.read_text()
        c.assert_consistent(stack, "v0")
        # a rank killed while its rank set was setting up the shared-memory all-reduce
        # leaves its segment file (named after the set's ports): planted here as such a
        # leftover, it is removed once that rank set has exited (restart, then stop)
        seg = _plant_segment(pid)
        c.signal_quietly(c.child_pid(pid, "services.worker --rank 0"), signal.SIGKILL)
        c.wait_recovered(stack)
        assert not seg.exists(), f"{seg} left after the ranks were restarted"
        seg = _plant_segment(pid)
        # the engine's state bucket works under the embedded server's role permissions
        assert c.ctl(stack, "/v1/pause").status_code == 200
        engine = int(c.status(stack)["engine_pid"])
        c.signal_quietly(engine, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while (st := c.wait_recovered(stack))["engine_pid"] == engine:
            assert time.monotonic() < deadline, stack.log_tail()
            time.sleep(0.3)
        assert st["state"] == "paused", st
        assert c.ctl(stack, "/v1/resume").status_code == 200
        # the second death within the window is one too many: the stack stops, named
        c.signal_quietly(int(c.status(stack)["engine_pid"]), signal.SIGKILL)
        assert stack.proc.wait(60) == 1
        log = stack.log.read_text()
        assert "engine exited with code -9; engine restarted 1 times within 60s" in log, log
        assert not seg.exists(), f"{seg} left after the stack stopped"
    finally:
        stack.stop()
