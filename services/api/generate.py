"""The API side of one generation: send it to the engine, turn token chunks into text.

Per choice: incremental detokenization (never half a UTF-8 character), stop strings
(text is held back by ``len(longest stop) - 1`` characters so a stop string is never
half-streamed), and the weight-version spans. When every choice has ended on our side
(e.g. on a stop string) while the engine still runs it, the engine is told to cancel,
as it is when the client goes away.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from services.worker.tokenizer import IncrementalDecoder, Tokenizer
from shared import messages as m
from shared.bus import Bus, new_request_id
from shared.errors import ControlError
from shared.subjects import Subjects

IDLE_TIMEOUT_S = 30.0  # the engine heartbeats every 5 s while a request waits


@dataclass
class Delta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: str = ""
    finish_reason: str | None = None
    spans: list[m.VersionSpan] | None = None


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
        self.text += self.decoder.push(new_tokens) if new_tokens else ""
        final = chunk.finish_reason is not None
        if final:
            self.text += self.decoder.flush()
        cut = self._find_stop()
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
        elif final:
            self.finish_reason = chunk.finish_reason
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
        )
        self.emitted = end
        return delta

    def _find_stop(self) -> int | None:
        if not self.stops:
            return None
        start = max(0, self.emitted - self._hold())
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None


async def generate(
    bus: Bus,
    subjects: Subjects,
    tokenizer: Tokenizer,
    gen: m.GenRequest,
    stops: list[str],
    on_version: Callable[[str], None] = lambda v: None,
) -> AsyncIterator[Delta]:
    """Yield deltas of every choice until all have finished. Raises ``ControlError``."""
    choices = [
        Choice(i, IncrementalDecoder(tokenizer, gen.prompt_token_ids), stops) for i in range(gen.n)
    ]
    engine_done: set[int] = set()
    gen.request_id = gen.request_id or new_request_id()
    finished_cleanly = False
    try:
        async for rep in bus.stream(
            subjects.gen, m.pack(gen), idle_timeout=IDLE_TIMEOUT_S, request_id=gen.request_id
        ):
            chunk = m.unpack(rep.data, type=m.GenChunk)
            if chunk.heartbeat:
                continue
            if chunk.version:
                on_version(chunk.version)
            if chunk.error_code:
                raise ControlError(chunk.error_code, chunk.error_message)
            if chunk.finish_reason is not None:
                engine_done.add(chunk.index)
            if not 0 <= chunk.index < gen.n:
                continue
            delta = choices[chunk.index].push(chunk)
            if delta is not None and (delta.text or delta.token_ids or delta.finish_reason):
                yield delta
            if all(c.finish_reason is not None for c in choices):
                finished_cleanly = len(engine_done) == gen.n
                return
    finally:
        if not finished_cleanly:
            # the client left, a stop string ended it here, or it failed: free the engine
            await bus.publish(subjects.gen + ".cancel", m.json_encode(m.GenCancel(gen.request_id)))
