"""The API process: ``python -m services.api`` (uvicorn serving :func:`create_app`)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import importlib
import json
import logging
import os
import socket
import struct
import sys
from typing import Any

import uvicorn
from starlette.requests import Request

from services.api.app import create_app
from services.api.control import client_request_id
from services.api.deps import Deps
from shared.errors import UNAVAILABLE, ControlError
from shared.settings import settings_or_exit

# At SIGTERM the listener stays open while the requests in flight end (they are failed at
# once; LISTEN_ON_S at most), every new request answered 503; then the kernel completes
# no handshake any more, the event loop accepts the connections it already completed
# (LISTEN_ON_S at most) and the listener closes. LAST_REQUESTS_S: what those last
# connections get to send their request (and have it answered 503) before uvicorn
# closes the connections that are idle.
LISTEN_ON_S = 0.5
LAST_REQUESTS_S = 0.25
SO_ATTACH_FILTER = 26  # Linux <asm-generic/socket.h>; not in Python's socket module
# one classic BPF instruction, "ret #0": every packet dropped (struct sock_filter)
DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)
TCPI_UNACKED = 24  # struct tcp_info's tcpi_unacked: a listener's accept queue length


class ShutdownGate:
    """The API's ASGI app as uvicorn serves it: once :attr:`closing` (SIGTERM), every
    new HTTP request is answered at once with 503 ``the API is shutting down`` and
    ``Connection: close``, in its route's error shape (a control reply on control
    routes, ``/health``'s own, else OpenAI's); ``active`` counts the requests the app
    is still serving."""

    def __init__(self, app: Any, control_paths: list[str]) -> None:
        self.app = app
        self.control_paths = frozenset(control_paths)
        self.closing = False
        self.active = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.closing:
            await self._refuse(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = "the API is shutting down"
        path = scope.get("path", "")
        body: dict[str, Any]
        if path in self.control_paths:
            rid = client_request_id(Request(scope))
            body = {
                "request_id": rid,
                "error_code": UNAVAILABLE,
                "error_message": message,
                "result": None,
            }
        elif path == "/health":
            body = {"status": "unavailable", "error": message}
        else:
            body = {
                "error": {
                    "message": message,
                    "type": "server_error",
                    "param": None,
                    "code": UNAVAILABLE,
                }
            }
        # the body read first (a small one): a socket closed with unread bytes in its
        # receive queue sends a reset, which can overtake the answer
        more, left = True, 1 << 20
        while more and left > 0:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left
            left -= len(msg.get("body", b""))
            more = msg.get("more_body", False)
        data = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"connection", b"close"),
        ]
        headers += [(k, v) for k, v in scope["headers"] if k.lower() == b"x-request-id"][:1]
        await send({"type": "http.response.start", "status": UNAVAILABLE, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def _stop_handshakes(sock: Any) -> Any:
    """Drop every packet that reaches the listening socket ``sock`` (a socket filter):
    no connection joins its accept queue any more, and a client's SYN, unanswered, is
    sent again and then refused once the listener is closed — instead of a handshake
    completed by the kernel and reset when the listener closes. A duplicate of the
    socket is returned (to read the queue's length), None where this cannot be done."""
    try:
        dup = socket.socket(fileno=os.dup(sock.fileno()))
    except (OSError, ValueError):
        return None
    try:
        prog = ctypes.create_string_buffer(DROP_ALL)
        fprog = struct.pack("HL", 1, ctypes.addressof(prog))
        dup.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    except OSError:  # not Linux
        dup.close()
        return None
    return dup


def _queued(dup: Any) -> int:
    """Connections in a listener's accept queue (Linux ``TCP_INFO``); 0 if unknown."""
    try:
        info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        return int(struct.unpack_from("I", info, TCPI_UNACKED)[0])
    except (OSError, AttributeError, struct.error):
        return 0


class Server(uvicorn.Server):
    """uvicorn, plus: at shutdown every open generation (stream or not) and control call
    answers at once — a 503 error event then ``[DONE]`` on a stream, the engine told to
    cancel — instead of being cut off after the graceful timeout; and a request that
    arrives meanwhile gets a 503 (:class:`ShutdownGate`) until the listener closes,
    never a reset (uvicorn closes the listener first: the connections the kernel had
    accepted for it were reset)."""

    def __init__(self, config: uvicorn.Config, deps: Deps, gate: ShutdownGate) -> None:
        super().__init__(config)
        self.deps, self.gate = deps, gate

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        err = ControlError(UNAVAILABLE, "the API is shutting down")
        self.gate.closing = True

        async def keep_failing() -> None:
            # requests that were still arriving on kept-alive connections too
            while True:
                if self.deps.bus is not None:
                    self.deps.bus.fail_pending(err)
                await asyncio.sleep(0.05)

        task = asyncio.create_task(keep_failing())
        grace = self.config.timeout_graceful_shutdown
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await self._close_listeners()
            if grace is not None:
                # the listeners' phase spent part of the stop's budget (the launcher gives
                # the API 3 s): a stream whose client stopped reading must not get all of
                # uvicorn's graceful wait on top of it
                spent = loop.time() - t0
                self.config.timeout_graceful_shutdown = max(0.1, grace - spent)  # type: ignore[assignment]
            await super().shutdown(sockets)  # closes idle connections, waits for the rest
        finally:
            self.config.timeout_graceful_shutdown = grace
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # a SIGTERM / SIGINT is a clean stop (exit 0): uvicorn would raise it again
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    async def _close_listeners(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LISTEN_ON_S
        while self.gate.active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        dups = [_stop_handshakes(s) for srv in self.servers for s in srv.sockets or ()]
        try:
            # the event loop accepts what the kernel still holds for us (bounded)
            deadline = loop.time() + LISTEN_ON_S
            while any(d is not None and _queued(d) for d in dups) and loop.time() < deadline:
                await asyncio.sleep(0.01)
        finally:
            for d in dups:
                if d is not None:
                    d.close()
        for srv in self.servers:
            srv.close()
        await asyncio.sleep(LAST_REQUESTS_S)


# the largest request head (request line + headers) the API reads; a larger one is
# refused (431 with httptools, 400 with h11) before it is buffered further
MAX_HEAD_BYTES = 64 * 1024

log = logging.getLogger("rollbus.api")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def server_choice() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser for the API: ``uvloop`` and ``httptools`` when
    importable (runtime dependencies; uvloop has no Windows build), else ``asyncio`` and
    ``h11``. The one place this is decided (the bench's bare route uses it too)."""
    loop = "uvloop" if _importable("uvloop") else "asyncio"
    http = "httptools" if _importable("httptools") else "h11"
    return loop, http


@functools.cache
def bounded_httptools(head_timeout_s: float = 10.0) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a bound on the request head: its size, and its
    time — a connection that sends no complete head within ``head_timeout_s`` of opening
    (or of its head's first byte) is closed (400 when part of a head came). llhttp itself
    has no size bound (h11 has one: ``h11_max_incomplete_event_size``): without it a
    client could send megabytes of URL or headers and have them all buffered and handed
    to the app; and uvicorn times out only idle kept-alive connections, so without the
    time bound a client that never finishes its head (slowloris) held the connection
    for ever."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head_open = False  # a request's head is being read
        _head_size = 0  # bytes received while it was
        _too_big = False
        _head_timer: asyncio.TimerHandle | None = None

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if not self._head_open or (cycle is not None and not cycle.response_complete):
                # nothing of a request came (no one to answer), or a pipelined head stalled
                # behind a response still being sent (a 400 would land inside it)
                self.transport.close()
                return
            self.logger.warning("closed a connection whose request head was incomplete")
            self._refuse(
                b"400 Bad Request",
                f"request head incomplete after {head_timeout_s:g} s (ROLLBUS_BODY_TIMEOUT_S)",
            )

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()  # a connection that never sends a request

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._head_open, self._head_size = True, 0
            self._arm_head_timer()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._head_open = False
            self._cancel_head_timer()
            # the head as parsed: one read may have brought all of it
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > MAX_HEAD_BYTES:
                self._too_big = True
                # a callback error ends the parse: uvicorn answers (send_400_response)
                raise ValueError("request head too large")
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._too_big or not self._head_open or self.transport.is_closing():
                return
            # every byte fed with the head still open belonged to it (or, at most, to the
            # tail of a pipelined request before it in the same read)
            self._head_size += len(data)
            if self._head_size > MAX_HEAD_BYTES:
                self._too_big = True
                self.send_400_response("")

        def send_400_response(self, msg: str) -> None:
            if not self._too_big:
                super().send_400_response(msg)
                return
            self.logger.warning("refused a request head larger than %d bytes", MAX_HEAD_BYTES)
            self._refuse(
                b"431 Request Header Fields Too Large",
                f"request head larger than {MAX_HEAD_BYTES} bytes",
            )

        def _refuse(self, status: bytes, message: str) -> None:
            body = message.encode()
            self.transport.write(
                b"HTTP/1.1 " + status + b"\r\n"
                b"content-type: text/plain; charset=utf-8\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + body
            )
            self.transport.close()

    return BoundedHttpToolsProtocol


def uvicorn_config(app: Any, host: str, port: int, head_timeout_s: float = 10.0) -> uvicorn.Config:
    """The API's server settings (also the bench's bare-route baseline: like with like);
    ``head_timeout_s``: ``BODY_TIMEOUT_S``, for the request head too."""
    loop, http = server_choice()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop,
        http=bounded_httptools(head_timeout_s) if http == "httptools" else http,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,  # open streams end then: the whole stop is < 10 s
    )


def main() -> int:
    settings = settings_or_exit("rollbus-api")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s api %(levelname)s %(name)s: %(message)s",
    )
    app = create_app(settings)
    gate = ShutdownGate(app, app.state.control_paths)
    config = uvicorn_config(gate, settings.api_host, settings.api_port, settings.body_timeout_s)
    log.info("serving with loop=%s http=%s", *server_choice())
    server = Server(config, app.state.deps, gate)
    try:
        server.run()
    except SystemExit as e:
        return int(e.code or 0)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
