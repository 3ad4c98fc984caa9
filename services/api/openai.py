"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (with SSE
``stream: true``), ``/v1/models``.

vLLM extensions RL users rely on are accepted: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (sampled ``token_ids`` per choice and the
``prompt_token_ids``), ``return_tokens_as_token_ids`` (logprob tokens as
``"token_id:<id>"``). Every response carries ``weight_version``; a choice whose tokens
span a weight update also carries ``weight_versions: [{"version", "start", "end"}]``
(and so does the response when it has one choice).

Logprobs (of the raw model distribution, see ``services.worker.sampling``): completions
take ``logprobs: k`` and answer OpenAI's legacy shape (``top_logprobs`` per position: a
``{token: logprob}`` dict of the k most likely tokens plus the sampled one); chat takes
``logprobs: true, top_logprobs: k`` (``content[i].top_logprobs``: k ``{token, logprob,
bytes}``). ``/v1/completions`` takes a list of prompts: each is its own engine request,
choice ``index = prompt_index * n + j``, usage summed.

Every parameter is checked here, before the engine sees it (``schema``, ``body``): a
bad one answers 400 naming it in ``error.param``. A full engine queue answers 429 with
``Retry-After``. A client that goes away cancels its request in the engine; a stream
reader that falls ``ROLLBUS_STREAM_BUFFER`` chunks per choice behind loses its stream
(the connection is closed, the request cancelled). ``X-Request-Id`` is echoed back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
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
from services.api.generate import Calls, Delta, GenCall, eos_ids_of
from shared import messages as m
from shared.chat_template import RESERVED as RESERVED_TEMPLATE_ARGS
from shared.errors import TOO_MANY_REQUESTS, UNAUTHORIZED, ControlError

__all__ = ["BadRequest", "error_response", "routes"]

T = TypeVar("T")
log = logging.getLogger("rollbus.api.openai")
RETRY_AFTER_S = 1
INTERNAL_ERROR = 500
REQUEST_ID_HEADER = "x-request-id"


def _route(chat: bool) -> str:
    """The ``route`` label of the generation metrics."""
    return "chat" if chat else "completions"


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
    if code == UNAUTHORIZED:  # RFC 9110 §15.5.2: a 401 names the scheme it wants
        headers = {"WWW-Authenticate": "Bearer", **(headers or {})}
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


CLIENT_LEFT = "499"  # nginx's "client closed request": the status counted for a client that left


class BoundedStream(StreamingResponse):
    """An SSE response that gives up on a reader too slow to keep its buffer bounded:
    once ``gave_up`` is set, a write blocked on that reader is abandoned, the stream is
    closed (its request cancelled) and so is the connection."""

    def __init__(self, content: AsyncIterator[bytes], gave_up: asyncio.Event, **kw: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kw)
        self.gave_up = gave_up

    async def stream_response(self, send: Send) -> None:
        """The response is written by one task, raced once against ``gave_up`` (not two
        tasks per chunk): giving up cancels it wherever it waits (a blocked write, or
        the next chunk), closing the stream; the connection is then dropped."""

        async def write() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        body = self.body_iterator
        assert isinstance(body, AsyncIterator)
        writer = asyncio.ensure_future(write())
        giving_up = asyncio.ensure_future(self.gave_up.wait())
        try:
            await asyncio.wait({writer, giving_up}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done():
                writer.result()
        finally:
            giving_up.cancel()
            if not writer.done():
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            await body.aclose()  # type: ignore[attr-defined]


@dataclass
class Job:
    """A parsed generation request: one engine request per prompt."""

    gens: list[m.GenRequest]
    stops: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool
    logprobs: bool
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    as_token_ids: bool = False  # return_tokens_as_token_ids
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    keep_stop: bool = False  # include_stop_str_in_output
    skip_special: bool = True  # skip_special_tokens
    # the stop ids that end a choice as eos (stop_reason null: the tokenizer's eos, not
    # generation_config.json's others, see eos_ids_of); none with ignore_eos: an eos then
    # ends a choice only as a stop_token_ids one, named (vLLM V1)
    eos_ids: frozenset[int] = frozenset()

    @property
    def gen(self) -> m.GenRequest:
        """The first (for chat: the only) engine request."""
        return self.gens[0]

    @property
    def num_choices(self) -> int:
        return len(self.gens) * self.gen.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(g.prompt_token_ids) for g in self.gens)


Label = Callable[[int], str]


def _alternatives(token: int, logprob: float, top: m.TopLogprobs | None) -> list[tuple[int, float]]:
    """The alternatives at one position, the sampled token's value being its own logprob
    (the float64 one) wherever it appears."""
    if top is None:
        return []
    return [(t, logprob if t == token else v) for t, v in zip(top.ids, top.logprobs, strict=True)]


def completion_logprobs(
    ids: list[int],
    logprobs: list[float],
    tops: list[m.TopLogprobs] | None,
    label: Label,
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` object of a completion choice: ``top_logprobs`` per
    position is a ``{token: logprob}`` dict of the alternatives plus the sampled token
    (two ids with the same text share one key, as in OpenAI's shape). ``text_offset``
    counts from ``offset`` (a stream's chunk continues its choice's count)."""
    toks = [label(t) for t in ids]
    offsets, pos = [], offset
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    top_dicts = []
    for i, (tid, tok, lp) in enumerate(zip(ids, toks, logprobs, strict=False)):
        top = tops[i] if tops and i < len(tops) else None
        d: dict[str, float] = {}
        for alt, v in _alternatives(tid, lp, top):
            d.setdefault(label(alt), v)
        d.setdefault(tok, lp)
        top_dicts.append(d)
    return {
        "tokens": toks,
        "token_logprobs": logprobs,
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    ids: list[int],
    logprobs: list[float],
    tops: list[m.TopLogprobs] | None,
    label: Label,
) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: ``content[i].top_logprobs`` lists the
    alternatives (``top_logprobs`` of them, most likely first) as ``{token, logprob,
    bytes}``."""
    content = []
    for i, (tid, lp) in enumerate(zip(ids, logprobs, strict=False)):
        top = tops[i] if tops and i < len(tops) else None
        entry = _entry(label(tid), lp)
        entry["top_logprobs"] = [_entry(label(a), v) for a, v in _alternatives(tid, lp, top)]
        content.append(entry)
    return {"content": content}


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
        from shared.model_config import (
            GenerationDefaults,
            generation_defaults,
            max_model_len,
            model_vocab_size,
        )
        from shared.tokenizer import load_tokenizer

        self.deps = deps
        s = deps.settings
        self.model = s.served_model_name
        # as vLLM names a model served from a path: the path as given is its id too
        # (and the resolved path), unless ROLLBUS_MODEL_NAME names it otherwise
        self.model_ids = {self.model}
        if s.model and not s.model_name:
            self.model_ids |= {s.model, str(s.model_dir.resolve())}
        self.tokenizer = load_tokenizer(s.model_dir)
        self._texts: dict[int, str] = {}  # token id -> its text in logprobs
        self.max_model_len = max_model_len(s.model_dir, s.max_model_len)
        # tokens one sequence can hold in the engine's KV cache (the same settings): a
        # default max_tokens stays within it (the engine refuses a request past it)
        self.kv_tokens = s.kv_cache_blocks * s.kv_block_size
        # token ids are checked against the model's embedding rows (config.json's
        # vocab_size), not the tokenizer's size: a padded vocabulary accepts every id the
        # model has, a tokenizer with more ids than the model cannot feed it an unknown one
        self.vocab_size = model_vocab_size(s.model_dir, self.tokenizer.vocab_size)
        # as vLLM's --generation-config auto: generation_config.json's sampling fields are
        # the defaults of a request that does not set them (a field out of range stops
        # the start, naming it: the launcher checks it first)
        self.defaults = (
            generation_defaults(s.model_dir)
            if s.generation_config == "auto"
            else GenerationDefaults()
        )
        if self.defaults.items():
            log.info(
                "request defaults from generation_config.json (ROLLBUS_GENERATION_CONFIG="
                "none: OpenAI's): %s",
                self.defaults.items(),
            )
        # generation requests received and not yet sent to the engine: each one sent
        # tells the engine how many more are coming (``GenRequest.more``), so that an idle
        # engine starts a burst in one step (README "Admission")
        self.incoming = 0

    # ------------------------------------------------------------------ parsing

    def _auth(self, request: Request) -> None:
        key = self.deps.settings.api_key
        if key and not bearer_ok(request.headers.get("authorization", ""), key):
            raise BadRequest("missing or wrong API key (Authorization: Bearer <key>)", code=401)

    @staticmethod
    def _content_type(request: Request) -> None:
        """A generation body is JSON: ``Content-Type`` absent, ``application/json`` or
        ``application/<x>+json`` (any parameters). Anything else is 400 naming the
        header: vLLM refuses it too, and a browser page may send ``text/plain`` JSON
        without a CORS preflight."""
        value = request.headers.get("content-type")
        if value is None:
            return  # a raw client that sends no type: its body is read as JSON
        media = value.split(";", 1)[0].strip().lower()
        kind, _, sub = media.partition("/")
        if kind != "application" or not (sub == "json" or sub.endswith("+json")):
            raise BadRequest(
                f"Content-Type {value[:100]!r} is not JSON: send 'Content-Type: application/json'",
                "content-type",
            )

    def _prompts(self, req: schema.Sampling, body: dict[str, Any], n: int) -> list[list[int]]:
        """Every prompt's token ids: chat renders its messages; a completion's ``prompt``
        is a string, a list of strings, token ids, or a list of token-id lists, whose
        number times ``n`` is bounded by ``ROLLBUS_MAX_N`` (checked before encoding)."""
        if isinstance(req, schema.ChatRequest):
            kwargs = req.chat_template_kwargs or {}
            if clash := sorted(RESERVED_TEMPLATE_ARGS & set(kwargs)):
                raise BadRequest(
                    f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs"
                )
            cont = bool(req.continue_final_message)
            gen_prompt = (
                not cont if req.add_generation_prompt is None else req.add_generation_prompt
            )
            if cont and gen_prompt:
                raise BadRequest(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    "continue_final_message",
                )
            try:  # the raw messages: a template may use fields the schema does not name
                text = self.tokenizer.apply_chat_template(
                    body["messages"],
                    add_generation_prompt=gen_prompt,
                    chat_template_kwargs=kwargs,
                    continue_final_message=cont,
                )
            except Exception as e:  # noqa: BLE001 - a template rejecting the chat is a 400
                raise BadRequest(f"the chat template refused 'messages': {e}", "messages") from e
            return [self.tokenizer.encode(text, add_special_tokens=False)]
        assert isinstance(req, schema.CompletionRequest)
        prompt: Any = req.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]  # one prompt of token ids
        elif prompt and all(isinstance(p, str | list) for p in prompt):
            items = list(prompt)
        else:
            raise BadRequest(
                "'prompt' must be a string, a list of strings, a list of token ids or a list "
                "of token-id lists (not empty, not mixed with bare ids)",
                "prompt",
            )
        max_n = self.deps.settings.max_n
        if len(items) * n > max_n:
            raise BadRequest(
                f"{len(items)} prompts x n={n} make {len(items) * n} choices; the limit is "
                f"{max_n} (ROLLBUS_MAX_N)",
                "prompt",
            )
        prompts = []
        for i, item in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            if not ids:
                raise BadRequest(f"{where} is empty", "prompt")
            if not all(t < self.vocab_size for t in ids):
                raise BadRequest(f"{where}: token id out of the vocabulary", "prompt")
            prompts.append(ids)
        return prompts

    def parse(self, body: Any, chat: bool) -> Job:
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object", "body")
        try:
            req = schema.convert(body, schema.ChatRequest if chat else schema.CompletionRequest)
        except msgspec.ValidationError as e:
            param = m.error_param(e) or "body"
            raise BadRequest(f"'{param}': {m.error_text(e)}", param) from None
        if req.model is not None and req.model not in self.model_ids:
            raise BadRequest(
                f"model '{req.model}' does not exist; this server serves '{self.model}'", "model"
            )
        if refused := schema.unsupported(body, chat):
            raise BadRequest(refused[1], refused[0])
        n, max_n = req.n or 1, self.deps.settings.max_n
        if n > max_n:
            raise BadRequest(f"n is {n}; the limit is {max_n} (ROLLBUS_MAX_N)", "n")
        prompts = self._prompts(req, body, n)
        if (keep := req.truncate_prompt_tokens) is not None:
            keep = self.max_model_len if keep == -1 else keep
            if not 1 <= keep <= self.max_model_len:
                raise BadRequest(
                    f"truncate_prompt_tokens must be -1 or 1 ... {self.max_model_len} "
                    "(the maximum context length)",
                    "truncate_prompt_tokens",
                )
            prompts = [ids[-keep:] for ids in prompts]  # the last ones, as vLLM
        if req.best_of is not None and req.best_of != n:
            raise BadRequest("best_of other than n is not supported", "best_of")
        max_name, max_tokens = "max_tokens", req.max_tokens
        if req.max_completion_tokens is not None:
            max_name, max_tokens = "max_completion_tokens", req.max_completion_tokens
        budgets = [self._budget(ids, max_name, max_tokens, chat) for ids in prompts]
        if req.min_tokens and req.min_tokens > min(budgets):
            raise BadRequest(
                f"min_tokens ({req.min_tokens}) is more than {max_name} ({min(budgets)})",
                "min_tokens",
            )
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = list(req.stop_token_ids or [])
        if any(t >= self.vocab_size for t in stop_ids):
            raise BadRequest("stop_token_ids: token id out of the vocabulary", "stop_token_ids")
        bias_map: dict[int, float] = {}
        bias_keys: dict[int, str] = {}  # the key that named each id
        for key, value in (req.logit_bias or {}).items():  # OpenAI's keys: ids as strings
            # zeros stripped first: int() refuses a string of over 4300 digits (ValueError,
            # a 500), and "0…07" is still token 7
            digits = key.lstrip("0") or "0"
            if not (
                key.isascii()
                and key.isdigit()
                and len(digits) <= len(str(self.vocab_size))
                and int(digits) < self.vocab_size
            ):
                raise BadRequest(
                    f"logit_bias: key {key[:32]!r} is not a token id in the vocabulary",
                    "logit_bias",
                )
            token = int(digits)
            # "7" and "07" name one token: which value holds would be the JSON parser's
            # choice (ours keeps the last), so such a body is refused, as a duplicate key is
            if (first := bias_keys.setdefault(token, key)) != key:
                raise BadRequest(
                    f"logit_bias: keys {first[:256]!r} and {key[:256]!r} name one token id "
                    f"({token})",
                    "logit_bias",
                )
            bias_map[token] = value
        bias = m.LogitBias(list(bias_map), list(bias_map.values())) if bias_map else None
        if not req.ignore_eos:
            stop_ids += self.tokenizer.stop_token_ids  # every eos id of the model's configs
        if isinstance(req, schema.ChatRequest):
            logprobs, top = bool(req.logprobs), req.top_logprobs or 0
            if top and not logprobs:
                raise BadRequest("top_logprobs needs 'logprobs': true", "top_logprobs")
        else:
            assert isinstance(req, schema.CompletionRequest)
            logprobs, top = req.logprobs is not None, req.logprobs or 0
            if req.echo:
                raise BadRequest("echo is not supported", "echo")
            if req.suffix:
                raise BadRequest("suffix is not supported", "suffix")
            if body.get("top_logprobs"):  # chat's field: here it would be ignored
                raise BadRequest(
                    "top_logprobs is chat's; completions take 'logprobs': k (the "
                    "alternatives per position)",
                    "top_logprobs",
                )
        opts = req.stream_options
        if body.get("stream_options") and not req.stream:
            # as vLLM and FastDeploy (OpenAI: "only set this when you set stream: true")
            raise BadRequest(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        sampling = self.defaults.merge(
            {
                "temperature": req.temperature,
                "top_p": req.top_p,
                "top_k": req.top_k,
                "repetition_penalty": req.repetition_penalty,
                "min_p": req.min_p,
            }
        )
        allowed = None
        if req.allowed_token_ids is not None:
            if any(t >= self.vocab_size for t in req.allowed_token_ids):
                raise BadRequest(
                    "allowed_token_ids: token id out of the vocabulary", "allowed_token_ids"
                )
            allowed = list(dict.fromkeys(req.allowed_token_ids))
        bad = self._bad_words(req.bad_words) if req.bad_words else None
        gens = [
            m.GenRequest(
                request_id=uuid.uuid4().hex,
                prompt_token_ids=ids,
                max_tokens=budget,
                n=n,
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=max(0, sampling["top_k"]),  # -1: off, as 0
                seed=req.seed,
                logprobs=logprobs,
                top_logprobs=top,
                stop_token_ids=stop_ids,
                logit_bias=bias,
                min_tokens=req.min_tokens or 0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=sampling["repetition_penalty"],
                min_p=sampling["min_p"],
                allowed_token_ids=allowed,
                bad_words=bad,
                max_staleness=req.max_staleness,
                # not streamed, no stop strings: no token is read before the end
                coalesce=not req.stream and not stops,
            )
            for ids, budget in zip(prompts, budgets, strict=True)
        ]
        return Job(
            gens,
            stops,
            bool(req.stream),
            bool(opts and opts.include_usage),
            bool(req.return_token_ids),
            chat,
            logprobs,
            as_token_ids=bool(req.return_tokens_as_token_ids),
            # as vLLM and FastDeploy: only with include_usage (alone it adds nothing)
            continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
            keep_stop=bool(req.include_stop_str_in_output),
            skip_special=req.skip_special_tokens is not False,
            eos_ids=frozenset() if req.ignore_eos else eos_ids_of(self.tokenizer),
        )

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """vLLM's ``bad_words`` as token sequences (``SamplingParams.update_from_tokenizer``):
        each word, stripped on the left, is encoded as it is and with one leading space;
        the second is kept when it is another word of the same length (a word at the
        start of the text and one inside it are different tokens)."""
        out: list[list[int]] = []
        for i, word in enumerate(words):
            if not word.strip():
                raise BadRequest(f"bad_words[{i}] is empty", "bad_words")
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (
                (plain, spaced) if spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,)
            ):
                if len(ids) > m.MAX_BAD_WORD_TOKENS or any(t >= self.vocab_size for t in ids):
                    raise BadRequest(
                        f"bad_words[{i}]: more than {m.MAX_BAD_WORD_TOKENS} tokens or a token "
                        "out of the vocabulary",
                        "bad_words",
                    )
                out.append(ids)
        return out

    def _budget(self, ids: list[int], max_name: str, max_tokens: int | None, chat: bool) -> int:
        """``max_tokens`` for one prompt (its default when not given), within the context."""
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise BadRequest(
                f"prompt has {len(ids)} tokens; the maximum context length is {self.max_model_len}",
                "prompt" if not chat else "messages",
            )
        if max_tokens is None:
            kv_room = self.kv_tokens - len(ids)
            if kv_room <= 0:
                raise BadRequest(
                    f"prompt has {len(ids)} tokens; the KV cache holds {self.kv_tokens} tokens "
                    "per sequence (ROLLBUS_KV_CACHE_BLOCKS x ROLLBUS_KV_BLOCK_SIZE)",
                    "prompt" if not chat else "messages",
                )
            room = min(room, kv_room)  # a context longer than the cache: the cache's rest
            if not chat:
                return min(16, room)  # OpenAI's and vLLM's default (the file's is not used)
            # vLLM: generation_config.json's max_new_tokens, else the rest of the context
            return min(room, self.defaults.max_tokens or room)
        if max_tokens > room:
            raise BadRequest(
                f"prompt ({len(ids)} tokens) + {max_name} ({max_tokens}) exceeds the maximum "
                f"context length {self.max_model_len}",
                max_name,
            )
        return max_tokens

    # ------------------------------------------------------------------ responses

    def _label(self, job: Job) -> Label:
        if job.as_token_ids:
            return lambda t: f"token_id:{t}"
        return self._token_text

    def _token_text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def _logprobs(
        self,
        job: Job,
        token_ids: list[int],
        logprobs: list[float],
        tops: list[m.TopLogprobs] | None = None,
        offsets: dict[int, int] | None = None,
        index: int = 0,
    ) -> Any:
        """The ``logprobs`` of a choice (or of a stream chunk: ``offsets`` keeps each
        choice's ``text_offset`` count across its chunks)."""
        if not job.logprobs:
            return None
        if job.chat:
            return chat_logprobs(token_ids, logprobs, tops, self._label(job))
        start = 0 if offsets is None else offsets.get(index, 0)
        out = completion_logprobs(token_ids, logprobs, tops, self._label(job), start)
        if offsets is not None:
            offsets[index] = start + sum(len(t) for t in out["tokens"])
        return out

    def _versions(
        self,
        body: dict[str, Any],
        job: Job,
        spans: dict[int, list[m.VersionSpan]],
    ) -> None:
        first = spans.get(0) or []
        body["weight_version"] = first[-1].version if first else self.deps.current_version
        if job.num_choices == 1 and len(first) > 1:
            body["weight_versions"] = [
                {"version": s.version, "start": s.start, "end": s.end} for s in first
            ]

    async def complete(self, job: Job, call: Calls) -> dict[str, Any]:
        acc: dict[int, dict[str, Any]] = {
            i: {
                "text": "",
                "token_ids": [],
                "logprobs": [],
                "top": [],
                "finish_reason": None,
                "stop_reason": None,
                "spans": [],
            }
            for i in range(job.num_choices)
        }
        first = _FirstToken(self.deps)
        async for d in call.deltas():
            first.seen(d)
            a = acc[d.index]
            a["text"] += d.text
            a["token_ids"] += d.token_ids
            a["logprobs"] += d.logprobs
            a["top"] += d.top
            if d.finish_reason:
                a["finish_reason"] = d.finish_reason
                a["stop_reason"] = d.stop_reason
                a["spans"] = d.spans or []
        choices = []
        for i, a in acc.items():
            c: dict[str, Any] = {"index": i}
            if job.chat:
                c["message"] = {"role": "assistant", "content": a["text"]}
            else:
                c["text"] = a["text"]
            c["logprobs"] = self._logprobs(job, a["token_ids"], a["logprobs"], a["top"])
            c["finish_reason"] = a["finish_reason"]
            c["stop_reason"] = a["stop_reason"]  # vLLM's: which stop string or token id
            if job.return_token_ids:
                c["token_ids"] = a["token_ids"]
                if len(job.gens) > 1:
                    c["prompt_token_ids"] = job.gens[i // job.gen.n].prompt_token_ids
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
                "prompt_tokens": job.prompt_tokens,
                "completion_tokens": out_tokens,
                "total_tokens": job.prompt_tokens + out_tokens,
            },
        }
        if job.return_token_ids and len(job.gens) == 1:
            body["prompt_token_ids"] = job.gen.prompt_token_ids
        self._versions(body, job, {i: a["spans"] for i, a in acc.items()})
        self.deps.metrics.gen_tokens.inc(out_tokens)
        return body

    async def sse(self, job: Job, call: Calls) -> AsyncIterator[bytes]:
        rid = ("chatcmpl-" if job.chat else "cmpl-") + job.gen.request_id
        created = int(time.time())
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        offsets: dict[int, int] = {}  # per choice: text_offset continues across chunks
        out_tokens = 0
        first = _FirstToken(self.deps)

        def usage() -> dict[str, int]:
            p = job.prompt_tokens
            return {
                "prompt_tokens": p,
                "completion_tokens": out_tokens,
                "total_tokens": p + out_tokens,
            }

        def event(choice: dict[str, Any] | None, extra: dict[str, Any]) -> bytes:
            body: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model,
                "choices": [choice] if choice is not None else [],
                **extra,
            }
            if job.continuous_usage and "usage" not in body:
                body["usage"] = usage()  # so far (vLLM's and FastDeploy's option)
            return f"data: {json.dumps(body)}\n\n".encode()

        # as OpenAI, vLLM and FastDeploy: a chat stream opens each choice with its role
        # alone (content ""), before any token; later deltas carry content only. Sent with
        # the first delta, whose version is known (an API just started has seen none)
        roles = job.chat
        ended = False  # the stream ran to its end or its error event: else its client left
        try:
            route = "chat" if job.chat else "completions"
            async for d in call.deltas():
                if roles:
                    roles = False
                    version = {"weight_version": d.version or self.deps.current_version}
                    delta = {"role": "assistant", "content": ""}
                    for i in range(job.num_choices):
                        choice = dict(index=i, delta=delta, logprobs=None, finish_reason=None)
                        yield event(choice, version)
                first.seen(d)
                out_tokens += len(d.token_ids)
                if d.finish_reason:  # each choice's outcome, as a non-streamed call counts
                    self.deps.metrics.gen_requests.labels(route, d.finish_reason).inc()
                yield event(*self._sse_choice(job, d, offsets))
            ended = True
        except ControlError as e:
            ended = True
            self.deps.metrics.gen_errors.labels(_route(job.chat), str(e.code)).inc()
            param = (e.result or {}).get("param")
            kind = "invalid_request_error" if e.code == 400 else "server_error"
            err = {"error": {"message": e.message, "type": kind, "param": param, "code": e.code}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        except Exception as e:  # noqa: BLE001 - a bug: logged, counted, the stream told
            ended = True
            self.deps.metrics.gen_errors.labels(_route(job.chat), str(INTERNAL_ERROR)).inc()
            yield f"data: {json.dumps(self._internal(e, rid, 'sse_writer'))}\n\n".encode()
        finally:
            # counted here: a client that left mid-stream was sent these tokens too
            self.deps.metrics.gen_tokens.inc(out_tokens)
            if not ended:  # it left mid-stream (or was dropped as too slow): 499, as a
                # non-streamed request whose client left
                self.deps.metrics.gen_errors.labels(_route(job.chat), CLIENT_LEFT).inc()
            await call.close()
        if job.include_usage:
            yield event(None, {"usage": usage()})
        yield b"data: [DONE]\n\n"

    def _sse_choice(
        self, job: Job, d: Delta, offsets: dict[int, int]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One delta as a stream chunk's choice, and the chunk's own fields."""
        c: dict[str, Any] = {"index": d.index}
        if job.chat:
            c["delta"] = {"content": d.text}
        else:
            c["text"] = d.text
        c["logprobs"] = self._logprobs(job, d.token_ids, d.logprobs, d.top, offsets, d.index)
        c["finish_reason"] = d.finish_reason
        if d.finish_reason:
            c["stop_reason"] = d.stop_reason  # vLLM's, on the choice's last chunk
        if job.return_token_ids:
            c["token_ids"] = d.token_ids
        extra: dict[str, Any] = {"weight_version": d.version or self.deps.current_version}
        if d.finish_reason and d.spans and len(d.spans) > 1:
            spans = [{"version": s.version, "start": s.start, "end": s.end} for s in d.spans]
            c["weight_versions"] = spans
            if job.num_choices == 1:
                extra["weight_versions"] = spans
        return c, extra

    def _seen(self, version: str) -> None:
        self.deps.current_version = version

    # ------------------------------------------------------------------ routes

    async def handle(self, request: Request, chat: bool) -> Response:
        client_id = request.headers.get(REQUEST_ID_HEADER)
        resp = await self._handle(request, chat)
        if resp.status_code >= 400:  # a stream's error event is counted by ``sse``
            self.deps.metrics.gen_errors.labels(_route(chat), str(resp.status_code)).inc()
        if client_id is not None:
            resp.headers[REQUEST_ID_HEADER] = client_id  # echoed, never used on the bus
        return resp

    async def _handle(self, request: Request, chat: bool) -> Response:
        route = "chat" if chat else "completions"
        s = self.deps.settings
        incoming = False
        try:
            self._auth(request)
            self._content_type(request)  # before the body is read
            raw = await read_body(request, s.max_body_bytes, s.body_timeout_s)
            self.incoming += 1  # read (a slow body does not count): parsed and sent next
            incoming = True
            # off the event loop: a chat template (untrusted jinja) or a long prompt's
            # tokenization is CPU work that would stall every other request and stream;
            # so is the JSON itself (a 4 MiB body of a million tiny values: seconds)
            job = await asyncio.to_thread(lambda: self.parse(parse_json(raw, empty={}), chat))
            assert self.deps.bus is not None
            self.incoming -= 1
            incoming = False
            for i, gen in enumerate(job.gens):  # this job's later prompts, others received
                gen.more = self.incoming + len(job.gens) - 1 - i
            gave_up = asyncio.Event()
            call = Calls(
                [
                    GenCall(
                        self.deps.bus,
                        self.deps.subjects,
                        self.tokenizer,
                        gen,
                        job.stops,
                        self._seen,
                        max_unread=s.stream_buffer * gen.n,  # a step sends n chunks at once
                        on_overflow=gave_up.set,
                        # the engine heartbeats every CONTROL_TIMEOUT_S / 3 at most: silence
                        # this long means it is gone (killed, or NATS lost)
                        idle_timeout=s.control_timeout_s,
                        keep_stop=job.keep_stop,
                        skip_special_tokens=job.skip_special,
                        eos_ids=job.eos_ids,
                    )
                    for gen in job.gens
                ]
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
            # nobody reads it; the engine was told to cancel
            return Response(status_code=int(CLIENT_LEFT))
        except Exception as e:  # noqa: BLE001 - a bug: logged, counted, answered as OpenAI's
            return JSONResponse(self._internal(e, "", "generation"), INTERNAL_ERROR)
        finally:
            if incoming:  # refused, or the client left, before it was sent
                self.incoming -= 1

    def _internal(self, e: Exception, rid: str, task: str) -> dict[str, Any]:
        """An unexpected exception of a generation request (``task``: its handler or its
        SSE writer): ERROR with its traceback, ``rollbus_task_failures_total{process="api",
        task}``, and the error (OpenAI's shape) that tells its client."""
        log.error("%s %s failed", task, rid, exc_info=e)
        self.deps.metrics.task_failures.labels("api", task).inc()
        message = f"internal error: {type(e).__name__}: {e}"[:500]
        err = {"message": message, "type": "server_error", "param": None, "code": INTERNAL_ERROR}
        return {"error": err}

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "rollbus",
            "root": self.model,  # the id, never a filesystem path
            "max_model_len": self.max_model_len,
        }

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except BadRequest as e:
            return error_response(e.message, e.code)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def retrieve(self, request: Request) -> Response:
        """``GET /v1/models/{model}`` (the client's ``models.retrieve``): the served
        model's entry under any id a request may name it by, else 404."""
        try:
            self._auth(request)
        except BadRequest as e:
            return error_response(e.message, e.code)
        name = request.path_params["model"]
        if not name:  # `/v1/models/`: the list, as `/v1/models` (vLLM redirects there)
            return JSONResponse({"object": "list", "data": [self._card()]})
        if name not in self.model_ids:
            return error_response(
                f"model '{name[:256]}' does not exist; this server serves '{self.model}'",
                404,
                "model",
            )
        return JSONResponse(self._card())


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
        Route("/v1/models/{model:path}", r.retrieve, methods=["GET"]),
    ]
