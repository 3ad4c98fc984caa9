"""Control routes: parse the HTTP request, call ``rollbus.<i>.ctl.<method>``, map the reply.

Thin on purpose: every decision is the engine's. The HTTP status is the reply's
``error_code``; the body is the control reply itself.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.api.deps import Deps, bearer_ok
from shared import messages as m
from shared.bus import new_request_id
from shared.errors import BAD_REQUEST, NOT_FOUND, UNAUTHORIZED, ControlError


def admin_check(deps: Deps, request: Request) -> None:
    token = deps.settings.admin_token
    if not token:
        return
    got = request.headers.get("authorization", "")
    if not bearer_ok(got, token):
        what = "missing" if not got else "wrong"
        raise ControlError(
            UNAUTHORIZED, f"control routes need 'Authorization: Bearer <admin token>' ({what})"
        )


def reply_response(reply: m.ControlReply) -> JSONResponse:
    return JSONResponse(m.to_builtins(reply), status_code=reply.error_code)


async def call(deps: Deps, request: Request, method: str, args: dict[str, Any] | bytes) -> Response:
    return reply_response(await call_reply(deps, request, method, args))


async def call_reply(
    deps: Deps, request: Request, method: str, args: dict[str, Any] | bytes
) -> m.ControlReply:
    rid = request.headers.get("x-request-id") or new_request_id()
    try:
        admin_check(deps, request)
        data = args if isinstance(args, bytes) else json.dumps(args).encode()
        reply = await deps.control(method, data, rid, actor=f"http:{_client(request)}")
    except ControlError as e:
        reply = m.ControlReply(rid, e.code, e.message, None)
    deps.metrics.control(method, reply.error_code)
    return reply


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


def _query_args(request: Request, *names: str) -> dict[str, Any]:
    """Query parameters as control arguments. A repeated one is joined with commas
    (``tags=weight&tags=kv_cache``); an empty one counts as absent (``mode=``)."""
    out: dict[str, Any] = {}
    for n in names:
        values = [v for v in request.query_params.getlist(n) if v.strip()]
        if values:
            out[n] = ",".join(values)
    return out


async def _body(request: Request) -> bytes:
    body = await request.body()
    if body.strip():
        try:
            json.loads(body)
        except ValueError as e:
            raise ControlError(BAD_REQUEST, f"body is not valid JSON: {e}") from None
    return body


def routes(deps: Deps) -> list[Route]:
    async def pause(request: Request) -> Response:
        return await call(deps, request, "pause", _query_args(request, "mode"))

    async def resume(request: Request) -> Response:
        return await call(deps, request, "resume", {})

    async def is_paused(request: Request) -> Response:
        reply = await call_reply(deps, request, "is_paused", b"{}")
        if reply.error_code == 200 and reply.result is not None:
            return JSONResponse({"is_paused": reply.result["is_paused"]})
        return reply_response(reply)

    async def sleep(request: Request) -> Response:
        return await call(deps, request, "sleep", _query_args(request, "tags"))

    async def wakeup(request: Request) -> Response:
        return await call(deps, request, "wakeup", _query_args(request, "tags"))

    async def update_weights(request: Request) -> Response:
        try:
            admin_check(deps, request)  # 401 before the body is even looked at
            body = await _body(request)
        except ControlError as e:
            return reply_response(m.ControlReply(new_request_id(), e.code, e.message))
        return await call(deps, request, "update_weights", body or b"{}")

    async def status(request: Request) -> Response:
        reply = await call_reply(deps, request, "status", b"{}")
        if reply.error_code == 200 and reply.result is not None:
            return JSONResponse(reply.result)
        return reply_response(reply)

    def legacy(method: str):  # noqa: ANN202 - route factory
        async def route(request: Request) -> Response:
            try:
                admin_check(deps, request)  # these GETs change state: token first
            except ControlError as e:
                return reply_response(m.ControlReply(new_request_id(), e.code, e.message))
            if not deps.settings.dynamic_load_weight:
                return JSONResponse(
                    {"error": "Dynamic Load Weight Disabled."}, status_code=NOT_FOUND
                )
            return await call(deps, request, method, {})

        return route

    return [
        Route("/v1/pause", pause, methods=["POST"]),
        Route("/v1/resume", resume, methods=["POST"]),
        Route("/v1/is_paused", is_paused, methods=["GET"]),
        Route("/v1/sleep", sleep, methods=["POST"]),
        Route("/v1/wakeup", wakeup, methods=["POST"]),
        Route("/v1/update_weights", update_weights, methods=["POST"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/clear_load_weight", legacy("sleep"), methods=["GET"]),
        Route("/update_model_weight", legacy("wakeup"), methods=["GET"]),
    ]
