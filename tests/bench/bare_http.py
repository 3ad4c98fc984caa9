"""The HTTP baseline: a bare Starlette route that does one raw nats-py request.

``python -m tests.bench.bare_http NATS_URL SUBJECT PORT`` serves ``GET /bare`` with
uvicorn on 127.0.0.1:PORT, with the API's own uvicorn settings, event loop and HTTP
parser included (:func:`services.api.main.uvicorn_config`: uvloop and httptools when
importable); each call requests SUBJECT once and answers ``{"is_paused": false}``. What
rollbus adds over this is its own HTTP path."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

import nats
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
    import uvicorn

    from services.api.main import uvicorn_config

    url, subject, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = uvicorn_config(create_app(url, subject), "127.0.0.1", port)
    uvicorn.Server(config).run()
