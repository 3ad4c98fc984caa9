"""The API side of one generation: send it to the engine, turn token chunks into text.

Per choice: incremental detokenization (never half a UTF-8 character), stop strings
(text is held back by ``len(longest stop) - 1`` characters so a stop string is never
half-streamed), and the weight-version spans. When every choice has ended on our side
(e.g. on a stop string) while the engine still runs it, the engine is told to cancel,
as it is when the client goes away.

Several prompts in one call (``/v1/completions`` with a list): :class:`Calls` sends each
as its own engine request (each admitted, bounded and cancelled on its own), numbers the
choices as OpenAI does (``prompt_index * n + choice``), and fails the whole call — every
other request cancelled — when any one is refused or fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared import messages as m
from shared.bus import Bus, new_request_id
from shared.errors import UNAVAILABLE, ControlError, Timeout
from shared.subjects import Subjects
from shared.tokenizer import IncrementalDecoder, Tokenizer

IDLE_TIMEOUT_S = 30.0  # default; the API passes CONTROL_TIMEOUT_S (engine heartbeats faster)

log = logging.getLogger("rollbus.api.generate")


def decode_chunk(data: bytes) -> m.GenChunk:
    """A token chunk from the engine, checked (its top logprobs: 4 bytes per id); a
    malformed one raises ``ValueError`` or a msgspec error."""
    chunk = m.unpack(data, type=m.GenChunk)
    for top in chunk.top or ():
        if len(top.packed) != 4 * len(top.ids):
            raise ValueError(f"{len(top.ids)} top ids but {len(top.packed)} bytes of logprobs")
    return chunk


def split_chunk(chunk: m.GenChunk) -> list[m.GenChunk]:
    """A chunk of several tokens (a step of several decode iterations) as one chunk per
    token, as one-token steps send them: a stream gets one event per token, and a stop
    string ends the choice at the token that completes it (no token after it is kept).
    ``finish_reason`` and ``spans`` go with the last."""
    n = len(chunk.token_ids)
    if n <= 1:
        return [chunk]
    lps, top = chunk.logprobs, chunk.top
    return [
        m.GenChunk(
            chunk.request_id,
            chunk.index,
            [tok],
            None if lps is None else lps[i : i + 1],
            chunk.version,
            chunk.finish_reason if i == n - 1 else None,
            chunk.spans if i == n - 1 else None,
            top=None if top is None else top[i : i + 1],
        )
        for i, tok in enumerate(chunk.token_ids)
    ]


def eos_ids_of(tokenizer: Tokenizer) -> frozenset[int]:
    """The stop ids that end a choice as *eos* (``stop_reason`` null): the tokenizer's own
    eos id only. The other eos ids the model names (``generation_config.json``'s,
    ``config.json``'s) end it as stop tokens, named in ``stop_reason`` — as vLLM, which
    adds them to the request's ``stop_token_ids`` (``update_from_generation_config``) and
    names a stop token's id there (``check_stop``): an RL loop can tell ``<|eot_id|>``
    from ``<|end_of_text|>``."""
    eos = tokenizer.eos_token_id
    return frozenset() if eos is None else frozenset({eos})


@dataclass
class Delta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: str = ""
    finish_reason: str | None = None
    spans: list[m.VersionSpan] | None = None
    top: list[m.TopLogprobs] = field(default_factory=list)  # per token, when asked
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id


@dataclass
class Choice:
    index: int
    decoder: IncrementalDecoder
    stops: list[str]
    text: str = ""  # decoded so far (may exceed what was emitted)
    emitted: int = 0  # characters of ``text`` already emitted
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    spans: list[m.VersionSpan] = field(default_factory=list)
    version: str = ""
    keep_stop: bool = False  # include_stop_str_in_output: the text ends with the stop string
    # vLLM's stop_reason: the matched stop string, or the stop token id when it is not
    # one of the model's eos ids (``eos_ids``); None for eos, length, abort
    stop_reason: str | int | None = None
    eos_ids: frozenset[int] = frozenset()

    def _hold(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def push(self, chunk: m.GenChunk) -> Delta | None:
        if self.finish_reason is not None:
            return None  # ended here on a stop string; the engine caught up later
        new_tokens = list(chunk.token_ids)
        if new_tokens:
            start, end = len(self.token_ids), len(self.token_ids) + len(new_tokens)
            if self.spans and self.spans[-1].version == chunk.version:
                self.spans[-1].end = end
            else:
                self.spans.append(m.VersionSpan(chunk.version, start, end))
        self.token_ids += new_tokens
        self.logprobs += list(chunk.logprobs or [])
        self.version = chunk.version or self.version
        final = chunk.finish_reason is not None
        # the stop token that ended the choice (a stop_token_ids one or eos: the engine's
        # "stop" comes with it last) stays in token_ids but is not written in the text,
        # as a stop string is cut — vLLM V1's detokenizer; include_stop_str_in_output keeps it
        shown = (
            new_tokens[:-1] if chunk.finish_reason == "stop" and not self.keep_stop else new_tokens
        )
        self.text += self.decoder.push(shown) if shown else ""
        if final:
            self.text += self.decoder.flush()
        cut = self._find_stop()
        if cut is not None:
            self.text = self.text[: cut[1] if self.keep_stop else cut[0]]
            self.finish_reason = "stop"
            self.stop_reason = cut[2]
        elif final:
            self.finish_reason = chunk.finish_reason
            if chunk.finish_reason == "stop" and new_tokens and new_tokens[-1] not in self.eos_ids:
                self.stop_reason = new_tokens[-1]
        hold = 0 if self.finish_reason else self._hold()
        end = max(self.emitted, len(self.text) - hold)
        delta = Delta(
            self.index,
            self.text[self.emitted : end],
            new_tokens,
            list(chunk.logprobs or []),
            self.version,
            self.finish_reason,
            self.spans if self.finish_reason else None,
            list(chunk.top or []),
            self.stop_reason,
        )
        self.emitted = end
        return delta

    def _find_stop(self) -> tuple[int, int, str] | None:
        """Start and end of the first stop string in the text (the one that starts first;
        of those, the longest, as the end is then the furthest), and that string."""
        if not self.stops:
            return None
        start = max(0, self.emitted - self._hold())
        hits = [(i, -len(s), s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        at, minus_len, stop = min(hits)
        return at, at - minus_len, stop


class GenCall:
    """One generation request on the bus: :meth:`open` sends it and waits until the
    engine has queued it or refused it (``ControlError``: 400, 429 queue full, ...);
    :meth:`deltas` then yields the deltas of every choice until all have finished.

    At most ``max_unread`` engine chunks wait for a slow reader; past that the request
    fails alone (``on_overflow`` is called at once, from the bus callback)."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        tokenizer: Tokenizer,
        gen: m.GenRequest,
        stops: list[str],
        on_version: Callable[[str], None] = lambda v: None,
        *,
        max_unread: int = 4096,
        on_overflow: Callable[[], None] = lambda: None,
        idle_timeout: float = IDLE_TIMEOUT_S,
        keep_stop: bool = False,
        skip_special_tokens: bool = True,
        eos_ids: frozenset[int] | None = None,
    ) -> None:
        """``eos_ids``: the stop tokens that are eos (``stop_reason`` null): by default
        :func:`eos_ids_of`, none with ``ignore_eos``."""
        self.bus, self.subjects, self.gen, self.on_version = bus, subjects, gen, on_version
        eos = eos_ids_of(tokenizer) if eos_ids is None else eos_ids
        gen.request_id = gen.request_id or new_request_id()
        gen.batch = True  # our bus takes the engine's batched chunks (one message per step)
        self.choices = [
            Choice(
                i,
                IncrementalDecoder(tokenizer, gen.prompt_token_ids, skip_special_tokens),
                stops,
                keep_stop=keep_stop,
                eos_ids=eos,
            )
            for i in range(gen.n)
        ]
        self.engine_done: set[int] = set()
        self._first: m.GenChunk | None = None
        self._replies = bus.stream(
            subjects.gen,
            m.pack(gen),
            idle_timeout=idle_timeout,
            request_id=gen.request_id,
            max_unread=max_unread,
            on_overflow=on_overflow,
        )
        self._finished_cleanly = False
        self._closed = False

    async def _next(self) -> m.GenChunk:
        try:
            rep = await self._replies.__anext__()
        except Timeout as e:  # no token and no heartbeat: name the engine, not an inbox
            raise ControlError(
                UNAVAILABLE,
                f"engine: no answer for {e.timeout:g}s (no heartbeat): it stopped or NATS "
                "is unreachable; the request was not completed",
            ) from None
        try:
            chunk = decode_chunk(rep.data)
        except (msgspec.MsgspecError, ValueError) as e:
            # not the engine's chunk (a bug, or a forged message): this request fails
            # alone, clearly, counted with the bus's dropped replies
            self.bus.dropped_replies += 1
            log.warning("request %s: malformed token chunk: %s", self.gen.request_id, e)
            raise ControlError(
                UNAVAILABLE,
                f"engine: malformed token chunk ({type(e).__name__}); the request was not "
                "completed",
            ) from None
        if chunk.version:
            self.on_version(chunk.version)
        if chunk.error_code:
            param = chunk.error_param or None
            raise ControlError(chunk.error_code, chunk.error_message, {"param": param})
        return chunk

    async def open(self) -> None:
        """Send the request; return once the engine has accepted it."""
        try:
            chunk = await self._next()
        except BaseException:
            await self.close()
            raise
        if not chunk.heartbeat:
            self._first = chunk  # an engine that does not acknowledge: a token already

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            while True:
                chunk, self._first = self._first or await self._next(), None
                if chunk.heartbeat:
                    continue
                if chunk.finish_reason is not None:
                    self.engine_done.add(chunk.index)
                if not 0 <= chunk.index < self.gen.n:
                    continue
                choice = self.choices[chunk.index]
                # a coalesced request's tokens are read at the end only: taken whole
                parts = [chunk] if self.gen.coalesce else split_chunk(chunk)
                for part in parts:
                    delta = choice.push(part)
                    if delta is not None and (delta.text or delta.token_ids or delta.finish_reason):
                        yield delta
                if all(c.finish_reason is not None for c in self.choices):
                    self._finished_cleanly = len(self.engine_done) == self.gen.n
                    return
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop listening; unless the engine ended every choice, tell it to cancel (the
        client left, a stop string ended it here, or it failed) so its KV is freed."""
        if self._closed:
            return
        self._closed = True
        await self._replies.aclose()
        if not self._finished_cleanly:
            cancel = m.json_encode(m.GenCancel(self.gen.request_id))
            await self.bus.publish(self.subjects.gen + ".cancel", cancel)


class Calls:
    """Several :class:`GenCall` of ``n`` choices each, as one: choice ``j`` of call ``i``
    is choice ``i * n + j``. :meth:`open` opens all of them concurrently; if any is
    refused, every other is cancelled and that (the first in order) error raised.
    :meth:`deltas` merges their deltas as they come; a failure of one ends the whole
    call (the others are cancelled)."""

    def __init__(self, calls: list[GenCall]) -> None:
        self.calls = calls
        self._pumps: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        try:
            results = await asyncio.gather(*(c.open() for c in self.calls), return_exceptions=True)
        except BaseException:  # cancelled (the client left): nothing may stay queued
            await self.close()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    async def deltas(self) -> AsyncIterator[Delta]:
        if len(self.calls) == 1:
            async for d in self.calls[0].deltas():
                yield d
            return
        done = object()
        # bounded: a slow reader holds the pumps back, so each call's own unread limit
        # (max_unread) still applies
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=len(self.calls))

        async def pump(i: int, call: GenCall) -> None:
            try:
                async for d in call.deltas():
                    d.index += i * call.gen.n
                    await queue.put(d)
            except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
                await queue.put(e)
            else:
                await queue.put(done)

        tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(self.calls)]
        self._pumps = tasks
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop every call (those the engine has not ended are cancelled there)."""
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.calls), return_exceptions=True)


async def generate(
    bus: Bus,
    subjects: Subjects,
    tokenizer: Tokenizer,
    gen: m.GenRequest,
    stops: list[str],
    on_version: Callable[[str], None] = lambda v: None,
) -> AsyncIterator[Delta]:
    """Yield deltas of every choice until all have finished. Raises ``ControlError``."""
    call = GenCall(bus, subjects, tokenizer, gen, stops, on_version)
    await call.open()
    async for d in call.deltas():
        yield d
