"""The API's shutdown gate: once closing, every request is answered 503 in its route's
error shape with ``Connection: close``, its body read first; before, the app answers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from services.api.main import ShutdownGate


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(gate: ShutdownGate, path: str, body: bytes = b"", rid: bytes = b"") -> list[Any]:
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"x-request-id", rid)] if rid else [],
        "query_string": b"",
    }
    chunks = [body[:3], body[3:]]
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        part = chunks.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(chunks)}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(gate(scope, receive, send))
    sent.append(chunks)  # what was left unread
    return sent


def test_open_gate_lets_the_app_answer() -> None:
    gate = ShutdownGate(_app, ["/v1/pause"])
    start, body, _ = _call(gate, "/v1/pause")
    assert start["status"] == 200 and body["body"] == b"ok" and gate.active == 0


def test_closing_gate_answers_503_in_each_routes_shape() -> None:
    gate = ShutdownGate(_app, ["/v1/pause"])
    gate.closing = True
    start, body, unread = _call(gate, "/v1/pause", b'{"mode": "abort"}', rid=b"r-1")
    assert start["status"] == 503 and unread == []  # the body was read
    headers = dict(start["headers"])
    assert headers[b"connection"] == b"close" and headers[b"x-request-id"] == b"r-1"
    assert json.loads(body["body"]) == {
        "request_id": "r-1",
        "error_code": 503,
        "error_message": "the API is shutting down",
        "result": None,
    }
    start, body, _ = _call(gate, "/health")
    assert json.loads(body["body"]) == {
        "status": "unavailable",
        "error": "the API is shutting down",
    }
    start, body, _ = _call(gate, "/v1/completions", b'{"prompt": "x"}')
    err = json.loads(body["body"])["error"]
    assert start["status"] == 503 and err["code"] == 503 and err["type"] == "server_error"
    assert err["message"] == "the API is shutting down"
