"""The free-port check of `rollbus serve`: TIME_WAIT is free, a listener is busy."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from services.launcher import Launcher, LaunchError
from services.natsd import port_is_free
from shared.settings import Settings


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


def test_ipv6_host_is_not_busy() -> None:
    """An IPv6 ``ROLLBUS_API_HOST`` (``::1``) was always "busy": the check bound AF_INET."""
    assert port_is_free("::1", 0)


def test_bad_api_host_is_named_not_called_busy(tmp_path: Path) -> None:
    """An unresolvable host was reported as "API port ... is busy: set ROLLBUS_API_PORT"."""
    s = Settings(api_host="no-such-host.invalid", api_port=8000, data_dir=tmp_path)
    with pytest.raises(LaunchError) as e:
        Launcher(s).prepare()
    msg = str(e.value)
    assert "ROLLBUS_API_HOST=no-such-host.invalid" in msg and "busy" not in msg, msg
