"""The free-port check of `rollbus serve`: TIME_WAIT is free, a listener is busy."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from services.natsd import port_is_free


def _time_wait(port: int) -> bool:
    for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = ln.split()
        if parts[3] == "06" and int(parts[1].rsplit(":", 1)[1], 16) == port:
            return True
    return False


def test_time_wait_socket_does_not_make_a_port_busy() -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    assert not port_is_free("127.0.0.1", port)  # a listener: busy
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its port goes to TIME_WAIT
    time.sleep(0.05)
    cli.close()
    srv.close()
    time.sleep(0.05)
    assert _time_wait(port)
    assert port_is_free("127.0.0.1", port)
