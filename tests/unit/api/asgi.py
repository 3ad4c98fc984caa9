"""A request as the API's route handlers get it, without a server."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request


def json_post(path: str, body: bytes) -> Request:
    """``POST path`` with a JSON ``body``: the whole body in one ``http.request``
    message, then ``http.disconnect``."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b""}
    return Request({**scope, "headers": headers}, receive)
