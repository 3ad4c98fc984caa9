"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (with SSE
``stream: true``), ``/v1/models``.

vLLM extensions RL users rely on are accepted: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (sampled ``token_ids`` per choice and the
``prompt_token_ids``). Every response carries ``weight_version``; a choice whose tokens
span a weight update also carries ``weight_versions: [{"version", "start", "end"}]``
(and so does the response when ``n == 1``). Logprobs are those of the sampled tokens;
alternatives (``top_logprobs``) are not computed and come back empty.

Every parameter is checked here, before the engine sees it (``schema``, ``body``): a
bad one answers 400 naming it in ``error.param``. A full engine queue answers 429 with
``Retry-After``. A client that goes away cancels its request in the engine; a stream
reader that falls ``ROLLBUS_STREAM_BUFFER`` chunks per choice behind loses its stream
(the connection is closed, the request cancelled). ``X-Request-Id`` is echoed back.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from services.api import schema
from services.api.body import BadRequest, parse_json, read_body
from services.api.deps import Deps, bearer_ok
from services.api.generate import Delta, GenCall
from shared import messages as m
from shared.errors import TOO_MANY_REQUESTS, ControlError

__all__ = ["BadRequest", "error_response", "routes"]

T = TypeVar("T")
RETRY_AFTER_S = 1
REQUEST_ID_HEADER = "x-request-id"


def error_response(
    message: str, code: int = 400, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }
    body = {
        "error": {
            "message": message,
            "type": kind.get(code, "server_error"),
            "param": param,
            "code": code,
        }
    }
    if code == TOO_MANY_REQUESTS:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(body, status_code=code, headers=headers)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client disconnects first: then cancel it (its request
    is cancelled in the engine) and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


class BoundedStream(StreamingResponse):
    """An SSE response that gives up on a reader too slow to keep its buffer bounded:
    once ``gave_up`` is set, a write blocked on that reader is abandoned, the stream is
    closed (its request cancelled) and so is the connection."""

    def __init__(self, content: AsyncIterator[bytes], gave_up: asyncio.Event, **kw: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kw)
        self.gave_up = gave_up

    async def stream_response(self, send: Send) -> None:
        async def guarded(message: Any) -> bool:
            sending = asyncio.ensure_future(send(message))
            giving_up = asyncio.ensure_future(self.gave_up.wait())
            await asyncio.wait({sending, giving_up}, return_when=asyncio.FIRST_COMPLETED)
            giving_up.cancel()
            if not sending.done():
                sending.cancel()
                return False
            sending.result()
            return True

        body = self.body_iterator
        assert isinstance(body, AsyncIterator)
        try:
            if not await guarded(
                {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
            ):
                return
            async for chunk in body:
                if not await guarded(
                    {"type": "http.response.body", "body": chunk, "more_body": True}
                ):
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await body.aclose()  # type: ignore[attr-defined]


@dataclass
class Job:
    """A parsed generation request."""

    gen: m.GenRequest
    stops: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool
    logprobs: bool
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)


class _FirstToken:
    """Observes time-to-first-token once per request."""

    def __init__(self, deps: Deps) -> None:
        self.deps, self.t0, self.done = deps, time.perf_counter(), False

    def seen(self, d: Delta) -> None:
        if not self.done and d.token_ids:
            self.done = True
            self.deps.metrics.ttft.observe(time.perf_counter() - self.t0)


class OpenAIRoutes:
    def __init__(self, deps: Deps) -> None:
        from services.engine.generation import max_model_len
        from services.worker.tokenizer import load_tokenizer

        self.deps = deps
        s = deps.settings
        self.model = s.served_model_name
        self.tokenizer = load_tokenizer(s.model_dir)
        self.max_model_len = max_model_len(s.model_dir, s.max_model_len)

    # ------------------------------------------------------------------ parsing

    def _auth(self, request: Request) -> None:
        key = self.deps.settings.api_key
        if key and not bearer_ok(request.headers.get("authorization", ""), key):
            raise BadRequest("missing or wrong API key (Authorization: Bearer <key>)", code=401)

    def _prompt_ids(self, req: schema.Sampling, body: dict[str, Any]) -> list[int]:
        if isinstance(req, schema.ChatRequest):
            try:  # the raw messages: a template may use fields the schema does not name
                text = self.tokenizer.apply_chat_template(
                    body["messages"], add_generation_prompt=True
                )
            except Exception as e:  # noqa: BLE001 - a template rejecting the chat is a 400
                raise BadRequest(f"the chat template refused 'messages': {e}", "messages") from e
            return self.tokenizer.encode(text, add_special_tokens=False)
        assert isinstance(req, schema.CompletionRequest)
        prompt: Any = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and all(isinstance(t, int) for t in prompt):
            if not all(t < self.tokenizer.vocab_size for t in prompt):
                raise BadRequest("prompt token id out of the vocabulary", "prompt")
            return list(prompt)
        raise BadRequest(
            "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
        )

    def parse(self, body: Any, chat: bool) -> Job:
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object", "body")
        try:
            req = schema.convert(body, schema.ChatRequest if chat else schema.CompletionRequest)
        except msgspec.ValidationError as e:
            param = m.error_param(e) or "body"
            raise BadRequest(f"'{param}': {m.error_text(e)}", param) from None
        if req.model is not None and req.model != self.model:
            raise BadRequest(
                f"model '{req.model}' does not exist; this server serves '{self.model}'", "model"
            )
        ids = self._prompt_ids(req, body)
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise BadRequest(
                f"prompt has {len(ids)} tokens; the maximum context length is {self.max_model_len}",
                "prompt" if not chat else "messages",
            )
        max_name, max_tokens = "max_tokens", req.max_tokens
        if isinstance(req, schema.ChatRequest) and req.max_completion_tokens is not None:
            max_name, max_tokens = "max_completion_tokens", req.max_completion_tokens
        if max_tokens is None:
            max_tokens = room if chat else min(16, room)
        if max_tokens > room:
            raise BadRequest(
                f"prompt ({len(ids)} tokens) + {max_name} ({max_tokens}) exceeds the maximum "
                f"context length {self.max_model_len}",
                max_name,
            )
        n, max_n = req.n or 1, self.deps.settings.max_n
        if n > max_n:
            raise BadRequest(f"n is {n}; the limit is {max_n} (ROLLBUS_MAX_N)", "n")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = list(req.stop_token_ids or [])
        if any(t >= self.tokenizer.vocab_size for t in stop_ids):
            raise BadRequest("stop_token_ids: token id out of the vocabulary", "stop_token_ids")
        if not req.ignore_eos:
            stop_ids += self.tokenizer.stop_token_ids  # every eos id of the model's configs
        logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        opts = req.stream_options
        gen = m.GenRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            n=n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            seed=req.seed,
            logprobs=logprobs,
            stop_token_ids=stop_ids,
            max_staleness=req.max_staleness,
        )
        return Job(
            gen,
            stops,
            bool(req.stream),
            bool(opts and opts.include_usage),
            bool(req.return_token_ids),
            chat,
            logprobs,
        )

    # ------------------------------------------------------------------ responses

    def _logprobs(self, job: Job, token_ids: list[int], logprobs: list[float]) -> Any:
        if not job.logprobs:
            return None
        toks = [self.tokenizer.decode([t]) for t in token_ids]
        if job.chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(toks, logprobs, strict=False)
                ]
            }
        offsets, pos = [], 0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": toks,
            "token_logprobs": logprobs,
            "top_logprobs": [{} for _ in toks],
            "text_offset": offsets,
        }

    def _versions(
        self,
        body: dict[str, Any],
        job: Job,
        spans: dict[int, list[m.VersionSpan]],
    ) -> None:
        first = spans.get(0) or []
        body["weight_version"] = first[-1].version if first else self.deps.current_version
        if job.gen.n == 1 and len(first) > 1:
            body["weight_versions"] = [
                {"version": s.version, "start": s.start, "end": s.end} for s in first
            ]

    async def complete(self, job: Job, call: GenCall) -> dict[str, Any]:
        acc: dict[int, dict[str, Any]] = {
            i: {"text": "", "token_ids": [], "logprobs": [], "finish_reason": None, "spans": []}
            for i in range(job.gen.n)
        }
        first = _FirstToken(self.deps)
        async for d in call.deltas():
            first.seen(d)
            a = acc[d.index]
            a["text"] += d.text
            a["token_ids"] += d.token_ids
            a["logprobs"] += d.logprobs
            if d.finish_reason:
                a["finish_reason"] = d.finish_reason
                a["spans"] = d.spans or []
        choices = []
        for i, a in acc.items():
            c: dict[str, Any] = {"index": i}
            if job.chat:
                c["message"] = {"role": "assistant", "content": a["text"]}
            else:
                c["text"] = a["text"]
            c["logprobs"] = self._logprobs(job, a["token_ids"], a["logprobs"])
            c["finish_reason"] = a["finish_reason"]
            if job.return_token_ids:
                c["token_ids"] = a["token_ids"]
            if len(a["spans"]) > 1:
                c["weight_versions"] = [
                    {"version": s.version, "start": s.start, "end": s.end} for s in a["spans"]
                ]
            choices.append(c)
        out_tokens = sum(len(a["token_ids"]) for a in acc.values())
        body: dict[str, Any] = {
            "id": ("chatcmpl-" if job.chat else "cmpl-") + job.gen.request_id,
            "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(job.gen.prompt_token_ids),
                "completion_tokens": out_tokens,
                "total_tokens": len(job.gen.prompt_token_ids) + out_tokens,
            },
        }
        if job.return_token_ids:
            body["prompt_token_ids"] = job.gen.prompt_token_ids
        self._versions(body, job, {i: a["spans"] for i, a in acc.items()})
        self.deps.metrics.gen_tokens.inc(out_tokens)
        return body

    async def sse(self, job: Job, call: GenCall) -> AsyncIterator[bytes]:
        rid = ("chatcmpl-" if job.chat else "cmpl-") + job.gen.request_id
        created = int(time.time())
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        started: set[int] = set()
        out_tokens = 0
        first = _FirstToken(self.deps)
        try:
            async for d in call.deltas():
                first.seen(d)
                out_tokens += len(d.token_ids)
                yield self._sse_chunk(job, rid, created, obj, d, started)
        except ControlError as e:
            err = {"error": {"message": e.message, "type": "server_error", "code": e.code}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await call.close()
        if job.include_usage:
            p = len(job.gen.prompt_token_ids)
            usage = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model,
                "choices": [],
                "usage": {
                    "prompt_tokens": p,
                    "completion_tokens": out_tokens,
                    "total_tokens": p + out_tokens,
                },
            }
            yield f"data: {json.dumps(usage)}\n\n".encode()
        self.deps.metrics.gen_tokens.inc(out_tokens)
        yield b"data: [DONE]\n\n"

    def _sse_chunk(
        self, job: Job, rid: str, created: int, obj: str, d: Delta, started: set[int]
    ) -> bytes:
        c: dict[str, Any] = {"index": d.index}
        if job.chat:
            delta: dict[str, Any] = {"content": d.text}
            if d.index not in started:
                delta["role"] = "assistant"
                started.add(d.index)
            c["delta"] = delta
        else:
            c["text"] = d.text
        c["logprobs"] = self._logprobs(job, d.token_ids, d.logprobs)
        c["finish_reason"] = d.finish_reason
        if job.return_token_ids:
            c["token_ids"] = d.token_ids
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.model,
            "choices": [c],
            "weight_version": d.version or self.deps.current_version,
        }
        if d.finish_reason and d.spans and len(d.spans) > 1:
            spans = [{"version": s.version, "start": s.start, "end": s.end} for s in d.spans]
            c["weight_versions"] = spans
            if job.gen.n == 1:
                body["weight_versions"] = spans
        return f"data: {json.dumps(body)}\n\n".encode()

    def _seen(self, version: str) -> None:
        self.deps.current_version = version

    # ------------------------------------------------------------------ routes

    async def handle(self, request: Request, chat: bool) -> Response:
        client_id = request.headers.get(REQUEST_ID_HEADER)
        resp = await self._handle(request, chat)
        if client_id is not None:
            resp.headers[REQUEST_ID_HEADER] = client_id  # echoed, never used on the bus
        return resp

    async def _handle(self, request: Request, chat: bool) -> Response:
        route = "chat" if chat else "completions"
        s = self.deps.settings
        try:
            self._auth(request)
            raw = await read_body(request, s.max_body_bytes)
            job = self.parse(parse_json(raw, empty={}), chat)
            assert self.deps.bus is not None
            gave_up = asyncio.Event()
            call = GenCall(
                self.deps.bus,
                self.deps.subjects,
                self.tokenizer,
                job.gen,
                job.stops,
                self._seen,
                max_unread=s.stream_buffer * job.gen.n,  # a step sends n chunks at once
                on_overflow=gave_up.set,
                # the engine heartbeats every CONTROL_TIMEOUT_S / 3 at most: silence this
                # long means it is gone (killed, or NATS lost)
                idle_timeout=s.control_timeout_s,
            )
            await until_disconnect(request, call.open())  # refused (400/429/503) -> raises
            if job.stream:
                return BoundedStream(self.sse(job, call), gave_up)
            try:
                body = await until_disconnect(request, self.complete(job, call))
            finally:
                await call.close()
            for c in body["choices"]:
                self.deps.metrics.gen_requests.labels(route, str(c["finish_reason"])).inc()
            return JSONResponse(body)
        except BadRequest as e:
            return error_response(e.message, e.code, e.param)
        except ControlError as e:
            return error_response(e.message, e.code, (e.result or {}).get("param"))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the engine was told to cancel

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except BadRequest as e:
            return error_response(e.message, e.code)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "rollbus",
                        "root": self.model,  # the id, never a filesystem path
                        "max_model_len": self.max_model_len,
                    }
                ],
            }
        )


def routes(deps: Deps) -> list[Route]:
    r = OpenAIRoutes(deps)

    async def completions(request: Request) -> Response:
        return await r.handle(request, chat=False)

    async def chat(request: Request) -> Response:
        return await r.handle(request, chat=True)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", r.models, methods=["GET"]),
    ]
