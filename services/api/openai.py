"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (with SSE
``stream: true``), ``/v1/models``.

vLLM extensions RL users rely on are accepted: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (sampled ``token_ids`` per choice and the
``prompt_token_ids``). Every response carries ``weight_version``; a choice whose tokens
span a weight update also carries ``weight_versions: [{"version", "start", "end"}]``
(and so does the response when ``n == 1``). Logprobs are those of the sampled tokens;
alternatives (``top_logprobs``) are not computed and come back empty.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.api.deps import Deps, bearer_ok
from services.api.generate import Delta, generate
from shared import messages as m
from shared.errors import ControlError


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def error_response(message: str, code: int = 400, param: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
    body = {
        "error": {
            "message": message,
            "type": kind.get(code, "server_error"),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=code)


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


def _get(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise BadRequest(f"'{name}' must be {kinds}, got {v!r}", name)
    if not isinstance(v, kinds):
        raise BadRequest(f"'{name}' has the wrong type: {v!r}", name)
    return v


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

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise BadRequest(f"body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list", "messages")
            for msg in messages:
                if not isinstance(msg, dict) or "role" not in msg:
                    raise BadRequest("each message needs a 'role'", "messages")
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            if not all(0 <= t < self.tokenizer.vocab_size for t in prompt):
                raise BadRequest("prompt token id out of the vocabulary", "prompt")
            return list(prompt)
        raise BadRequest(
            "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
        )

    def parse(self, body: dict[str, Any], chat: bool) -> Job:
        model = body.get("model")
        if model is not None and model != self.model:
            raise BadRequest(
                f"model '{model}' does not exist; this server serves '{self.model}'", "model"
            )
        ids = self._prompt_ids(body, chat)
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise BadRequest(
                f"prompt has {len(ids)} tokens; the maximum context length is {self.max_model_len}",
                "prompt" if not chat else "messages",
            )
        default_max = 16 if not chat else room
        max_tokens = _get(
            body,
            "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
            int,
            default_max,
        )
        if max_tokens <= 0:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens > room:
            raise BadRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the maximum "
                f"context length {self.max_model_len}",
                "max_tokens",
            )
        n = _get(body, "n", int, 1)
        if not 1 <= n <= 128:
            raise BadRequest(f"n must be between 1 and 128, got {n}", "n")
        temperature = float(_get(body, "temperature", (int, float), 1.0))
        top_p = float(_get(body, "top_p", (int, float), 1.0))
        top_k = _get(body, "top_k", int, 0)
        if temperature < 0 or not 0 < top_p <= 1:
            raise BadRequest("temperature must be >= 0 and top_p in (0, 1]", "temperature")
        seed = _get(body, "seed", int, None)
        stop = body.get("stop") or []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise BadRequest("'stop' must be a string or a list of strings", "stop")
        stop_ids = list(_get(body, "stop_token_ids", list, []))
        if not _get(body, "ignore_eos", bool, False):
            stop_ids += self.tokenizer.stop_token_ids  # every eos id of the model's configs
        if chat:
            logprobs = bool(_get(body, "logprobs", bool, False))
        else:
            lp = _get(body, "logprobs", int, None)
            logprobs = lp is not None
        stream = bool(_get(body, "stream", bool, False))
        opts = body.get("stream_options") or {}
        gen = m.GenRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=max(0, top_k),
            seed=seed,
            logprobs=logprobs,
            stop_token_ids=stop_ids,
        )
        return Job(
            gen,
            stops,
            stream,
            bool(opts.get("include_usage")),
            bool(body.get("return_token_ids")),
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

    async def complete(self, job: Job) -> dict[str, Any]:
        acc: dict[int, dict[str, Any]] = {
            i: {"text": "", "token_ids": [], "logprobs": [], "finish_reason": None, "spans": []}
            for i in range(job.gen.n)
        }
        assert self.deps.bus is not None
        first = _FirstToken(self.deps)
        async for d in generate(
            self.deps.bus, self.deps.subjects, self.tokenizer, job.gen, job.stops, self._seen
        ):
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

    async def sse(self, job: Job) -> AsyncIterator[bytes]:
        rid = ("chatcmpl-" if job.chat else "cmpl-") + job.gen.request_id
        created = int(time.time())
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        started: set[int] = set()
        out_tokens = 0
        assert self.deps.bus is not None
        first = _FirstToken(self.deps)
        try:
            async for d in generate(
                self.deps.bus, self.deps.subjects, self.tokenizer, job.gen, job.stops, self._seen
            ):
                first.seen(d)
                out_tokens += len(d.token_ids)
                yield self._sse_chunk(job, rid, created, obj, d, started)
        except ControlError as e:
            err = {"error": {"message": e.message, "type": "server_error", "code": e.code}}
            yield f"data: {json.dumps(err)}\n\n".encode()
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
        route = "chat" if chat else "completions"
        try:
            self._auth(request)
            job = self.parse(await self._body(request), chat)
            if job.stream:
                return StreamingResponse(self.sse(job), media_type="text/event-stream")
            body = await self.complete(job)
            for c in body["choices"]:
                self.deps.metrics.gen_requests.labels(route, str(c["finish_reason"])).inc()
            return JSONResponse(body)
        except BadRequest as e:
            return error_response(e.message, e.code, e.param)
        except ControlError as e:
            return error_response(e.message, e.code)

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
