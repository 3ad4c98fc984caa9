"""The HTTP baseline: a bare Starlette route that does one raw nats-py request.

``python -m tests.bench.bare_http NATS_URL SUBJECT PORT`` serves ``GET /bare`` with
uvicorn on 127.0.0.1:PORT, with the API's own uvicorn settings
(:mod:`services.api.main`); each call requests SUBJECT once and answers
``{"is_paused": false}``. What rollbus adds over this is its own HTTP path."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

import nats
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def create_app(url: str, subject: str) -> Starlette:
    conn: dict[str, nats.NATS] = {}

    async def bare(request: Request) -> Response:
        await conn["nc"].request(subject, b"{}", timeout=5)
        return JSONResponse({"is_paused": False})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        conn["nc"] = await nats.connect(url)
        yield
        await conn["nc"].close()

    return Starlette(routes=[Route("/bare", bare, methods=["GET"])], lifespan=lifespan)


if __name__ == "__main__":
    url, subject, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = uvicorn.Config(  # the API's settings (services/api/main.py)
        create_app(url, subject),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()
