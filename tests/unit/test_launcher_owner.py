"""Which embedded nats-server a second `rollbus serve` of the same DATA_DIR joins: one
whose server and launcher both run (``DATA_DIR/nats/owner.json``), never a leftover."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.launcher import EmbeddedOwner, running_embedded


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_join_only_a_server_whose_launcher_runs(tmp_path: Path) -> None:
    (tmp_path / "nats").mkdir()
    assert running_embedded(tmp_path) is None  # no file
    server, launcher = _sleeper(), _sleeper()
    try:
        owner = EmbeddedOwner("nats://127.0.0.1:1", 1, server.pid, launcher.pid, "a")
        owner.write(tmp_path)
        assert EmbeddedOwner.read(tmp_path) == owner
        assert running_embedded(tmp_path) == owner
        # its launcher gone (the server dies with it): not joined
        EmbeddedOwner("nats://127.0.0.1:1", 1, server.pid, _dead_pid(), "a").write(tmp_path)
        assert running_embedded(tmp_path) is None
        # the server gone (its launcher may be restarting it): not joined now
        EmbeddedOwner("nats://127.0.0.1:1", 1, _dead_pid(), launcher.pid, "a").write(tmp_path)
        assert running_embedded(tmp_path) is None
    finally:
        for p in (server, launcher):
            p.kill()
            p.wait()
    # a zombie (not reaped yet) is no live server
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # until it has exited, without reaping it (a fixed sleep was too short on a loaded
        # host: an interpreter's start alone can take longer)
        os.waitid(os.P_PID, z.pid, os.WEXITED | os.WNOWAIT)
        EmbeddedOwner("nats://x:1", 1, z.pid, z.pid, "a").write(tmp_path)
        assert running_embedded(tmp_path) is None
    finally:
        z.wait()


def test_garbage_owner_file_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "nats").mkdir()
    EmbeddedOwner.path(tmp_path).write_text("{not json")
    assert running_embedded(tmp_path) is None
    EmbeddedOwner.path(tmp_path).write_text('{"url": "x"}')
    assert EmbeddedOwner.read(tmp_path) is None
