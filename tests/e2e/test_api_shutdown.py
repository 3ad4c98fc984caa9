"""An API process stopped (SIGTERM) while clients keep sending requests: every request
whose connection the API accepted gets an HTTP answer — the normal one, or a 503 in the
error shape of its route (``the API is shutting down``) — never a reset or a connection
closed without one; a connect after the listener closed is refused (fine: nothing was
accepted). A second API process on the shared stack's instance, so the requests reach a
real engine. Before, uvicorn closed the listener at once: the connections the kernel
had already accepted for it, and those accepted but not yet read, were reset (13 of
~4000 requests, in each of two runs)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from tests.e2e.stack import Stack, free_port, wait_healthy

CLIENTS = 24
BODY = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4}).encode()
# (method, path, body): a route answered in the API, a control call and a generation
# (both through the engine: in flight when the signal comes)
REQUESTS = [
    ("GET", "/v1/models", b""),
    ("GET", "/v1/is_paused", b""),
    ("POST", "/v1/completions", BODY),
]


def _request(port: int, method: str, path: str, body: bytes) -> tuple[str, bytes]:
    """One request on a new connection: ``("refused", b"")``, ``("answered", response)``
    or ``("reset", what)``: accepted, then reset or closed before any answer."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    except ConnectionRefusedError:
        return "refused", b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    got = b""
    try:
        with sock:
            sock.sendall(head.encode() + body)
            while chunk := sock.recv(65536):
                got += chunk
    except OSError as e:  # ConnectionResetError, BrokenPipeError
        return "reset", f"{e!r} after {got[:80]!r}".encode()
    if not got.startswith(b"HTTP/1.1 "):
        return "reset", b"closed without an answer: " + got[:80]
    return "answered", got


class Client(threading.Thread):
    def __init__(self, port: int, n: int) -> None:
        super().__init__(daemon=True)
        self.port, self.n = port, n
        self.stop = threading.Event()
        self.outcomes: list[tuple[str, str, bytes]] = []

    def run(self) -> None:
        # one route a client: those answered in the API connect again and again
        method, path, body = REQUESTS[self.n % len(REQUESTS)]
        while not self.stop.is_set():
            kind, data = _request(self.port, method, path, body)
            self.outcomes.append((kind, path, data))
            if kind == "refused":
                time.sleep(0.01)


def _status(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1])


def _body(resp: bytes) -> dict[str, object]:
    return dict(json.loads(resp.partition(b"\r\n\r\n")[2]))


def test_requests_during_shutdown_get_an_answer_or_a_refused_connect(
    stack: Stack, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "api.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.api"],
        env={**stack.env, "ROLLBUS_API_PORT": str(port)},
        stdout=open(log, "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    clients: list[Client] = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log, timeout=60)
        clients = [Client(port, n) for n in range(CLIENTS)]
        for cl in clients:
            cl.start()
        time.sleep(1.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text()[-3000:]
        stop_s = time.monotonic() - t0
        time.sleep(0.5)  # refused from here on
    finally:
        for cl in clients:
            cl.stop.set()
        for cl in clients:
            cl.join(60)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    outcomes = [o for cl in clients for o in cl.outcomes]
    kinds = Counter(k for k, _, _ in outcomes)
    resets = [(path, data) for k, path, data in outcomes if k == "reset"]
    assert not resets, (kinds, resets[:5], log.read_text()[-3000:])
    assert kinds["refused"] > 0 and kinds["answered"] > 0, kinds
    codes = Counter(_status(d) for k, _, d in outcomes if k == "answered")
    assert set(codes) <= {200, 503}, codes
    for k, path, data in outcomes:  # every 503: the API stopping, in its route's shape
        if k != "answered" or _status(data) != 503:
            continue
        body = _body(data)
        if path == "/v1/is_paused":
            assert body["error_code"] == 503 and "shutting down" in str(body["error_message"])
        else:
            err = body["error"]
            assert isinstance(err, dict) and err["code"] == 503, body
            assert "shutting down" in str(err["message"]), body
    print(dict(kinds), dict(codes), f"stopped in {stop_s:.2f}s")
