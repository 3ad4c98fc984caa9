"""The API's uvicorn: uvloop and httptools (runtime dependencies), asyncio and h11 when they
cannot be imported; either way a request head over ``MAX_HEAD_BYTES`` is refused."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from services.api.main import MAX_HEAD_BYTES, server_choice, uvicorn_config


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_the_api_serves_with_uvloop_and_httptools() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = uvicorn_config(Starlette(), "127.0.0.1", 0)
    assert server_choice() == ("uvloop", "httptools")
    assert config.loop == "uvloop"
    config.load()
    assert issubclass(config.http_protocol_class, HttpToolsProtocol)


def _without_uvloop_httptools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    monkeypatch.setitem(sys.modules, "httptools", None)


def test_without_them_it_falls_back_to_asyncio_and_h11(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_uvloop_httptools(monkeypatch)
    assert server_choice() == ("asyncio", "h11")
    config = uvicorn_config(Starlette(), "127.0.0.1", 0)
    config.load()
    assert config.http_protocol_class.__name__ == "H11Protocol"


def _serve(head_timeout_s: float = 10.0) -> tuple[int, uvicorn.Server, threading.Thread]:
    """A uvicorn with the API's config on a free port, in a thread."""

    async def echo(req: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(req.headers.get("x-big", ""))))

    app = Starlette(routes=[Route("/", echo)])
    config = uvicorn_config(app, "127.0.0.1", 0, head_timeout_s)
    config.log_level = "critical"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return server.servers[0].sockets[0].getsockname()[1], server, thread


def _stop(served: tuple[int, uvicorn.Server, threading.Thread]) -> None:
    served[1].should_exit = True
    served[2].join(10)


@pytest.fixture(params=["default", "fallback"])
def served(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The API's config (and the fallback) served: its port."""
    if request.param == "fallback":
        _without_uvloop_httptools(monkeypatch)
    s = _serve()
    yield s[0]
    _stop(s)


def _get(port: int, header_bytes: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        head = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
        try:  # the server may answer and close before all of it is sent
            s.sendall(head + b"a" * header_bytes + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        while b"\r\n\r\n" not in out:
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def test_a_request_head_over_the_bound_is_refused(served: int) -> None:
    ok = _get(served, MAX_HEAD_BYTES // 2)
    assert ok.startswith(b"HTTP/1.1 200"), ok[:100]
    refused = _get(served, 4 * MAX_HEAD_BYTES)  # arrives in several reads
    # 431 from the bounded httptools protocol, 400 from h11: never the app's 200
    assert refused.split(b" ", 2)[1] in (b"431", b"400"), refused[:100]


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_httptools_refuses_a_head_just_over_the_bound() -> None:
    # likely in one read: counted from the parsed head, not only from the reads
    served = _serve()
    try:
        got = _get(served[0], MAX_HEAD_BYTES + 512)
        assert got.startswith(b"HTTP/1.1 431"), got[:100]
        assert _get(served[0], MAX_HEAD_BYTES - 512).startswith(b"HTTP/1.1 200")
    finally:
        _stop(served)


def _read_all(s: socket.socket) -> bytes:
    """What the server sends until it closes (the socket's timeout: it never did)."""
    out = b""
    while True:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_a_connection_that_never_completes_its_head_is_closed() -> None:
    """Slowloris: a client that opens connections and sends part of a head (or nothing)
    must not hold them for ever — uvicorn times out only idle kept-alive connections."""
    served = _serve(head_timeout_s=0.5)
    try:
        port = served[0]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
            got = _read_all(s)  # socket.timeout (a test error) if the server holds it
        assert got.startswith(b"HTTP/1.1 400"), got[:100]
        assert b"request head incomplete" in got
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            assert _read_all(s) == b""  # nothing sent: closed, nothing answered
        # a kept-alive connection idle for longer than the head bound between requests is
        # still served (uvicorn's own keep-alive timeout governs that wait)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            for _ in range(2):
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                got = s.recv(4096)
                assert got.startswith(b"HTTP/1.1 200"), got[:100]
                time.sleep(1.0)
    finally:
        _stop(served)
