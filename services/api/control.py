"""Control routes: parse the HTTP request, call ``rollbus.<i>.ctl.<method>``, map the reply.

Thin on purpose: every decision is the engine's. The HTTP status is the reply's
``error_code``; the body is the control reply itself. Arguments are checked here first
with the engine's own argument structs (a bad one: 400, ``result.param`` names it),
and the body within ``ROLLBUS_MAX_BODY_BYTES``. A client's ``X-Request-Id`` is echoed
in the reply (header and ``request_id``) and travels to the engine only as a header.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.api.body import BadRequest, parse_json, read_body
from services.api.deps import Deps, bearer_ok
from shared import messages as m
from shared.bus import new_request_id
from shared.errors import BAD_REQUEST, NOT_FOUND, UNAUTHORIZED, ControlError
from shared.versions import check_version_arg


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


# GET /v1/is_paused's two answers, rendered once
_IS_PAUSED_BODY = {v: JSONResponse({"is_paused": v}).body for v in (False, True)}


def reply_response(reply: m.ControlReply) -> JSONResponse:
    # RFC 9110 §15.5.2: a 401 names the scheme it wants
    auth = {"WWW-Authenticate": "Bearer"} if reply.error_code == UNAUTHORIZED else None
    return JSONResponse(m.to_builtins(reply), status_code=reply.error_code, headers=auth)


# method -> its argument struct, checked in the API before the engine sees it
ARGS: dict[str, type] = {
    "pause": m.PauseArgs,
    "sleep": m.TagArgs,
    "wakeup": m.TagArgs,
    "update_weights": m.UpdateWeightsArgs,
    "resume": m.NoArgs,
}


def check_args(method: str, data: bytes) -> None:
    """Raise the engine's own 400 (naming the field) for arguments it would refuse."""
    kind = ARGS.get(method)
    if kind is None:
        return
    args = m.decode_args(data, kind)
    if isinstance(args, m.UpdateWeightsArgs) and args.version is not None:
        check_version_arg(args.version)
    if isinstance(args, m.TagArgs):
        try:
            args.tag_set()
        except ControlError as e:
            raise ControlError(e.code, e.message, {"param": "tags"}) from None


async def call(deps: Deps, request: Request, method: str, args: dict[str, Any] | bytes) -> Response:
    return _echo(request, reply_response(await call_reply(deps, request, method, args)))


def client_request_id(request: Request) -> str:
    """The client's ``X-Request-Id`` as the reply body's ``request_id`` (else a new id).
    Header bytes arrive as latin-1; an id sent as UTF-8 (``ünï``) is given back as sent,
    not as mojibake. The response header echoes the raw bytes either way."""
    rid = request.headers.get("x-request-id")
    if not rid:
        return new_request_id()
    if not rid.isascii():
        try:
            rid = rid.encode("latin-1").decode("utf-8")
        except UnicodeError:
            pass  # latin-1 text (what `requests` sends for "ü"): already right
    return rid


async def call_reply(
    deps: Deps, request: Request, method: str, args: dict[str, Any] | bytes
) -> m.ControlReply:
    rid = client_request_id(request)
    try:
        admin_check(deps, request)
        data = args if isinstance(args, bytes) else json.dumps(args).encode()
        check_args(method, data)
        reply = await deps.control(method, data, rid, actor=f"http:{_client(request)}")
        reply.request_id = rid
    except ControlError as e:
        reply = m.ControlReply(rid, e.code, e.message, e.result)
    deps.metrics.control(method, reply.error_code)
    return reply


def _echo(request: Request, resp: Response) -> Response:
    if "x-request-id" in request.headers:
        resp.headers["x-request-id"] = request.headers["x-request-id"]
    return resp


def _client(request: Request) -> str:
    client = request.scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


def _query_args(request: Request, *names: str) -> dict[str, Any]:
    """Query parameters as control arguments. A repeated one (only ``tags`` may repeat,
    see :func:`_only_query`) is joined with commas (``tags=weight&tags=kv_cache``); an
    empty one counts as absent (``mode=``)."""
    out: dict[str, Any] = {}
    for n in names:
        values = [v for v in request.query_params.getlist(n) if v.strip()]
        if values:
            out[n] = ",".join(values)
    return out


REPEATABLE_QUERY = frozenset({"tags"})  # a list: `tags=weight&tags=kv_cache` is joined


def _only_query(request: Request, *known: str) -> None:
    """A mutating call's query names only its own parameters: an unknown one (``mod=keep``
    for ``mode=keep``) is 400 naming it, as an unknown body field is — never dropped while
    the call goes on with its defaults (a pause that aborts, an update to version.txt)."""
    takes = ", ".join(known) or "none"
    for name in request.query_params:
        if name not in known:
            raise ControlError(
                BAD_REQUEST,
                f"unknown query parameter '{name[:64]}' (this call takes {takes})",
                {"param": name[:64]},
            )
        # only a list (tags) may repeat: `version=a&version=b` is ambiguous, never joined
        # into one value ("a,b") nor decided by its last one
        given = [v for v in request.query_params.getlist(name) if v.strip()]
        if len(given) > 1 and name not in REPEATABLE_QUERY:
            raise ControlError(
                BAD_REQUEST, f"bad argument '{name}': given {len(given)} times", {"param": name}
            )


def _bool_query(request: Request, name: str) -> bool:
    """A boolean query parameter: ``true``/``false``/``1``/``0`` (any case; empty or
    absent = false); anything else, or the parameter given more than once, is 400 naming
    it."""
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise ControlError(
            BAD_REQUEST, f"bad argument '{name}': given {len(values)} times", {"param": name}
        )
    value = values[0].strip().lower() if values else ""
    if value in ("", "false", "0"):
        return False
    if value in ("true", "1"):
        return True
    raise ControlError(
        BAD_REQUEST, f"bad argument '{name}': expected true or false", {"param": name}
    )


# a control body up to this size is parsed on the event loop (a few ms at most); a larger
# one on a thread: a 4 MiB body of a million tiny JSON values is seconds of CPU, and every
# other request (streams, /health, status) waited behind it
INLINE_PARSE_BYTES = 64 * 1024


async def _body_doc(deps: Deps, request: Request) -> tuple[bytes, Any]:
    """The checked JSON-object body of a control call and its document (None when
    blank); the token is checked first (401 before the body is even looked at)."""
    admin_check(deps, request)
    try:
        body = await read_body(request, deps.settings.max_body_bytes, deps.settings.body_timeout_s)
        if len(body) <= INLINE_PARSE_BYTES:
            doc = parse_json(body)
        else:
            doc = await asyncio.to_thread(parse_json, body)
    except BadRequest as e:
        raise ControlError(BAD_REQUEST, e.message, {"param": e.param}) from None
    if doc is not None and not isinstance(doc, dict):
        raise ControlError(BAD_REQUEST, "body must be a JSON object", {"param": "body"})
    return body, doc


async def _body(deps: Deps, request: Request) -> bytes:
    """The checked JSON-object body of a control call (see :func:`_body_doc`)."""
    return (await _body_doc(deps, request))[0]


def _refused(request: Request, e: ControlError) -> Response:
    rid = client_request_id(request)
    return _echo(request, reply_response(m.ControlReply(rid, e.code, e.message, e.result)))


async def _query_or_body(deps: Deps, request: Request, method: str, name: str) -> Response:
    """``method`` with argument ``name`` from the query, else from a JSON body
    (``{"mode": "keep"}``, ``{"tags": "weight"}`` or a list of tags): the query wins."""
    try:
        admin_check(deps, request)  # 401 before a bad parameter's 400
        _only_query(request, *([name] if name else []))
    except ControlError as e:
        return _refused(request, e)
    args = _query_args(request, name)
    if not args:
        try:
            _, doc = await _body_doc(deps, request)
        except ControlError as e:
            return _refused(request, e)
        if isinstance(doc, dict):
            # the whole body goes on: the engine's argument struct names a wrong or
            # unknown field (400), as it does over NATS; only the call's own argument may
            # be null or "" (= absent, as `mode=` in the query; the engine reads a NATS
            # caller's so too: ``m.decode_args``) — an unknown `{"mod": null}` dropped here
            # let the call run with its defaults (a pause that aborts)
            args = {k: v for k, v in doc.items() if not name or k != name or v not in (None, "")}
            value = args.get(name)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                args[name] = ",".join(value)
    return await call(deps, request, method, args)


def routes(deps: Deps) -> list[Route]:
    async def pause(request: Request) -> Response:
        return await _query_or_body(deps, request, "pause", "mode")

    async def resume(request: Request) -> Response:
        return await _query_or_body(deps, request, "resume", "")

    async def is_paused(request: Request) -> Response:
        reply = await call_reply(deps, request, "is_paused", b"{}")
        if reply.error_code == 200 and reply.result is not None:
            value = reply.result["is_paused"]
            if isinstance(value, bool):
                body = _IS_PAUSED_BODY[value]
                return _echo(request, Response(body, media_type="application/json"))
            return _echo(request, JSONResponse({"is_paused": value}))
        return _echo(request, reply_response(reply))

    async def sleep(request: Request) -> Response:
        return await _query_or_body(deps, request, "sleep", "tags")

    async def wakeup(request: Request) -> Response:
        return await _query_or_body(deps, request, "wakeup", "tags")

    async def update_weights(request: Request) -> Response:
        """Arguments from the query (``?version=v1&verify_checksum=true``) or, when it has
        none, from the JSON body."""
        try:
            admin_check(deps, request)  # 401 before a bad parameter's 400
            _only_query(request, "version", "verify_checksum")
            args: dict[str, Any] = _query_args(request, "version")
            if request.query_params.get("verify_checksum", "").strip():
                args["verify_checksum"] = _bool_query(request, "verify_checksum")
            if args:
                return await call(deps, request, "update_weights", args)
            body = await _body(deps, request)
        except ControlError as e:
            return _refused(request, e)
        return await call(deps, request, "update_weights", body or b"{}")

    async def status(request: Request) -> Response:
        try:
            admin_check(deps, request)  # 401 before a bad parameter's 400
            fresh = _bool_query(request, "fresh")
        except ControlError as e:
            return _refused(request, e)
        reply = await call_reply(deps, request, "status", b'{"fresh":true}' if fresh else b"{}")
        if reply.error_code == 200 and reply.result is not None:
            body = reply.result
            if deps.bus is not None:  # the API's own process and bus, beside the engine's
                body["api"] = {"pid": os.getpid(), "bus": deps.bus.counts()}
            return _echo(request, JSONResponse(body))
        return _echo(request, reply_response(reply))

    def legacy(method: str):  # noqa: ANN202 - route factory
        async def route(request: Request) -> Response:
            if request.method == "HEAD":
                # HEAD is safe (RFC 9110): a `curl -I` or a link checker must not sleep or
                # wake the engine (starlette routes HEAD to every GET route)
                return Response(status_code=405, headers={"Allow": "GET"})
            try:
                admin_check(deps, request)  # these GETs change state: token first
                _only_query(request)
            except ControlError as e:
                return _refused(request, e)  # names the parameter, echoes X-Request-Id
            if not deps.settings.dynamic_load_weight:
                return JSONResponse(
                    {"error": "Dynamic Load Weight Disabled."}, status_code=NOT_FOUND
                )
            return await call(deps, request, method, {})

        return route

    async def fleet_update_weights(request: Request) -> Response:
        from services.api import fleet

        return await fleet.update_weights(deps, request)

    return [  # the polled GETs first (routes are matched in order; the paths are distinct)
        Route("/v1/is_paused", is_paused, methods=["GET"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/v1/pause", pause, methods=["POST"]),
        Route("/v1/fleet/update_weights", fleet_update_weights, methods=["POST"]),
        Route("/v1/resume", resume, methods=["POST"]),
        Route("/v1/sleep", sleep, methods=["POST"]),
        Route("/v1/wakeup", wakeup, methods=["POST"]),
        Route("/v1/update_weights", update_weights, methods=["POST"]),
        Route("/clear_load_weight", legacy("sleep"), methods=["GET"]),
        Route("/update_model_weight", legacy("wakeup"), methods=["GET"]),
    ]
