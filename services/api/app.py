"""``create_app(settings, bus)`` -> the Starlette app: OpenAI routes + control routes."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.api import control, openai
from services.api.deps import Deps
from services.api.guard import CrossSiteGuard
from shared.bus import Bus, new_request_id
from shared.settings import Settings


def _loopback(host: str) -> bool:
    """The API listens on a loopback address only (enables the DNS-rebinding check)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# set by the launcher (``rollbus serve``) on the API it starts: its pid. The API's first
# /health 200 is signalled to it (SIGUSR1) before the reply leaves, so the launcher knows
# the stack was ready even when a process dies before its own probe saw it.
LAUNCHER_PID_ENV = "ROLLBUS_LAUNCHER_PID"
READY_SIGNAL = signal.SIGUSR1


def _tell_launcher_ready() -> None:
    try:
        pid = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    except ValueError:
        return
    if pid > 1 and pid == os.getppid():  # never a stranger (e.g. a reused pid)
        with contextlib.suppress(OSError):
            os.kill(pid, READY_SIGNAL)


def create_app(settings: Settings, bus: Bus | None = None) -> Starlette:
    """The app; connects its own bus at startup when none is given."""
    deps = Deps(settings, bus)
    told_ready = False

    async def health(request: Request) -> Response:
        """200 only when the engine is ready, every rank answers and the engine lists no
        problem (step loop stalled, a rank stuck in a step, a rank on another version,
        a task restarting); else 503 with every reason in ``error``."""
        reply = await deps.control("health", b"{}", new_request_id(), timeout=2.0)
        body = reply.result or {}
        problems = list(body.get("problems") or [])
        if reply.ok and body.get("ready") and body.get("ranks_alive") and not problems:
            nonlocal told_ready
            if not told_ready:
                told_ready = True
                _tell_launcher_ready()
            return JSONResponse({"status": "ok", **body})
        error = "; ".join(problems) or reply.error_message or "ranks not ready"
        return JSONResponse({"status": "unavailable", "error": error, **body}, status_code=503)

    async def metrics(request: Request) -> Response:
        reply = await deps.control("health", b"{}", new_request_id(), timeout=2.0)
        assert deps.bus is not None
        deps.metrics.refresh(
            reply.result if reply.ok else None,
            deps.bus.dropped_replies,
            deps.bus.callback_errors,
        )
        return Response(deps.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        owned = deps.bus is None
        if owned:
            deps.bus = await Bus.connect(settings.nats_url, "rollbus-api")
            deps.bus.fail_when_disconnected = True  # 503 at once while NATS is away
        try:
            yield
        finally:
            if owned and deps.bus is not None:
                await deps.bus.close()

    async def http_error(request: Request, exc: Exception) -> Response:
        # unknown routes and wrong methods answer JSON like every other error
        assert isinstance(exc, HTTPException)
        body = {
            "error": {
                "message": f"{exc.detail}: {request.method} {request.url.path}",
                "type": "invalid_request_error",
                "param": None,
                "code": exc.status_code,
            }
        }
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    control_routes = control.routes(deps)
    guard = Middleware(
        CrossSiteGuard,
        control_paths=[r.path for r in control_routes],
        allowed_origins=settings.allowed_origin_list,
        loopback_only=_loopback(settings.api_host),
    )
    middleware = [guard]
    if settings.allowed_origin_list:
        # a page of an allowed origin can then call the API from a browser: its preflight
        # (OPTIONS) is answered and the answers carry Access-Control-Allow-Origin; other
        # origins get neither (and the guard still refuses their state-changing calls)
        origins = [o.rstrip("/").lower() for o in settings.allowed_origin_list]
        cors = Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
        middleware = [cors, guard]
    app = Starlette(
        exception_handlers={HTTPException: http_error},
        routes=[
            *control_routes,  # first: the polled control GETs match in one or two tries
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *openai.routes(deps),
        ],
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.deps = deps
    app.state.control_paths = [r.path for r in control_routes]  # their 503 at shutdown
    return app
