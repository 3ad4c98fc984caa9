"""The engine's generation side: requests in, step loop, token chunks out — and what
pause / resume / sleep / update_weights do to running requests.

Gates: ``admit`` (start waiting requests) and ``run`` (step running ones).

* running: both open.
* pause abort: both closed; after the in-flight step, every live request ends with its
  partial output and ``finish_reason: "abort"``; its KV blocks are freed.
* pause wait: no admissions; running requests finish (pause returns once drained).
* pause keep: both closed; running requests keep their KV and continue after resume —
  re-prefilled (recomputed) first if the weights or the KV cache changed meanwhile.
* Requests that arrive while paused or asleep wait in the queue.

The step loop holds ``step_lock`` while steps are in flight; every scheduler change
(cancel, abort, resume, KV drop, weights changed) and every rank-state change
(update_weights, sleep, wakeup: :meth:`Generation.quiet`) takes it too, so none happens
while a step is in flight. Decode steps are pipelined (``ROLLBUS_STEP_PIPELINE``): the
next step goes out before the reply of the one in flight; a control call waiting for
the lock ends such a run after the steps already sent (see :meth:`Generation._one`).
A decode step may run several iterations (``ROLLBUS_DECODE_STEPS``: see the scheduler):
a cancel or control call arriving meanwhile takes effect after it, and while a control
call waits for the lock every step planned is one iteration; a choice's tokens of one
step go out in one chunk (the API splits it per token for streams). When a step fails,
the lock is held until the steps sent after it are settled too
(answered, their ranks known gone, or ``CONTROL_TIMEOUT_S`` after the failure: see
:meth:`Generation._settle`); the requests hear of the failure before that. Only a
cancelled loop (a restart of a wedged loop, shutdown) releases it without settling.

Supervision: the step loop and the heartbeats run under the engine's
:class:`~shared.tasks.Supervisor`. A loop failure ends every live request with 503 and
the loop restarts. ``last_progress`` is the loop's watermark: :meth:`stall` names a
loop that holds the step lock (a step in flight) without progress for ``STALL_S``;
past ``STALL_S + CONTROL_TIMEOUT_S`` the heartbeat task restarts the loop, so no client
is kept waiting by heartbeats alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.micro.service import Service

from services.engine import autoupdate, orphans, staleness
from services.engine.scheduler import Output, Plan, Request, Scheduler, Seq
from shared import jsonkeys
from shared import messages as m
from shared.bus import (
    DEADLINE,
    REQUEST_ID,
    BatchItem,
    Reply,
    Sent,
    batch_subject,
    pack_batches,
    unreadable_deadline,
)
from shared.errors import BAD_REQUEST, TOO_MANY_REQUESTS, UNAVAILABLE, ControlError, Timeout
from shared.model_config import max_model_len, vocab_size
from shared.ratelog import RateLimited
from shared.tasks import Supervisor

if TYPE_CHECKING:
    from services.engine.main import Engine

log = logging.getLogger("rollbus.engine.gen")
_flood = RateLimited(log)  # warnings any raw client can trigger

HEARTBEAT_S = 5.0
JSON_REPLY_TTL_S = 60.0  # a JSON client's reply subject is forgotten this long after its end
SETTLE_POLL_S = 0.1  # how often a settle after a failed step looks for ranks gone
GONE_POLL_S = 0.25  # a step not answered this long looks for ranks gone this often
COALESCE_STEPS = 16  # a coalesced request's held tokens go out at least this often (steps)
# ... and before they pass this share of the server's max_payload: a step may give a choice
# up to DECODE_STEPS tokens, each with up to 20 alternatives (~200 bytes: 16 steps of 32 are
# ~100 KB), and a chunk past max_payload failed its publish, and with it the step loop
COALESCE_PAYLOAD_SHARE = 4
# a held token's bytes in a chunk, at most: id and logprob (14), its ``top`` entry's own (4)
# and per alternative an id (5) and a float32 (4)
CHUNK_TOKEN_BYTES, CHUNK_ALT_BYTES = 18, 9
NATS_MAX_PAYLOAD = 1 << 20  # nats-server's default, when the bus cannot tell its own
# an idle start's quiet gap is at least this share of a step: a client's burst spreads as
# its host slows, and so do the steps (a busy shared host: 16 httpx requests over ≈ 40 ms
# against 3 ms), while a group that misses the first step costs the batch a whole step
QUIET_STEP_SHARE = 0.05
# a step's later decode iterations each get this many times a recent iteration's time on
# top of a step's bounds (Generation._bound): a slow iteration (a busy host, a longer
# batch) is no stall, a stopped rank is named about as soon as with one-token steps
ITER_MARGIN = 10.0

T = TypeVar("T")


def _cat(a: list[T] | None, b: list[T] | None) -> list[T] | None:
    return b if a is None else a if b is None else a + b


def _merge(held: m.GenChunk, chunk: m.GenChunk) -> None:
    """``held`` followed by ``chunk`` (of the same choice and version), as one chunk."""
    held.token_ids += chunk.token_ids
    held.logprobs = _cat(held.logprobs, chunk.logprobs)
    held.top = _cat(held.top, chunk.top)
    held.finish_reason, held.spans = chunk.finish_reason, chunk.spans


def _held_bytes(held: m.GenChunk) -> int:
    """An upper bound of ``held``'s token bytes (its ids, logprobs and alternatives)."""
    alts = len(held.top[-1].ids) if held.top else 0
    return len(held.token_ids) * (CHUNK_TOKEN_BYTES + CHUNK_ALT_BYTES * alts)


def _mergeable(held: m.GenChunk, chunk: m.GenChunk) -> bool:
    return (
        held.finish_reason is None
        and not held.error_code
        and not chunk.error_code
        and held.version == chunk.version
    )


class Refused(Exception):
    """A generation request the engine will not queue: ``code`` and the field."""

    def __init__(self, code: int, message: str, param: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.request_id = ""  # the refused request's own id, once it decoded


def is_msgpack_map(data: bytes) -> bool:
    """Whether a ``gen`` message is the API's msgpack (a map: fixmap 0x80-0x8f, map16/32).
    Anything else is a raw client's text and is read, and answered, as JSON: ``[]`` or
    ``junk`` get a JSON refusal about JSON, not a msgpack one about an int."""
    return bool(data) and (0x80 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF))


def decode_gen(data: bytes) -> m.GenRequest:
    """A ``gen`` message: msgpack (the API's), or JSON (a raw NATS client's; ``NaN`` as
    Python's json writes it is read, then refused naming its field)."""
    if is_msgpack_map(data):
        return m.unpack(data, type=m.GenRequest)
    try:
        return msgspec.json.decode(data, type=m.GenRequest)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError:
        doc = json.loads(data)  # NaN / Infinity literals; ValueError when not JSON at all
        return msgspec.convert(doc, type=m.GenRequest, strict=True)


def peek_request_id(data: bytes) -> str:
    """The ``request_id`` of a message that failed its check, when it has a usable one
    (its refusal then names it); else ""."""
    try:
        doc = m.unpack(data) if is_msgpack_map(data) else json.loads(data)
        rid = doc.get("request_id") if isinstance(doc, dict) else None
        if isinstance(rid, str) and 0 < len(rid) <= m.MAX_REQUEST_ID_LEN:
            rid.encode()
            return rid
    except Exception:  # noqa: BLE001, S110 - nothing to name
        pass
    return ""


class Generation:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        s = engine.settings
        self.max_model_len = max_model_len(s.model_dir, s.max_model_len)
        self.vocab_size = vocab_size(s.model_dir)
        engine.max_model_len = self.max_model_len
        self.sched = Scheduler(
            s.kv_cache_blocks,
            s.kv_block_size,
            s.max_batch_size,
            s.max_step_tokens,
            self.max_model_len,
        )
        self.admit = True
        self.run = True
        self.recompute = False  # weights or KV changed while requests were kept
        self.step_lock = asyncio.Lock()
        self.work = asyncio.Event()
        self.drained = asyncio.Event()
        self._cancels: list[str] = []
        self.step_seconds = 0.0  # step request sent -> reply received, summed
        self.rank_seconds = 0.0  # rank 0's own time in those steps (its reply says)
        self.between_seconds = 0.0  # reply received -> next step sent, back-to-back steps
        self.steps = 0
        self.rows = 0  # rows stepped, summed over steps
        self.iterations = 0  # decode iterations (forward passes), summed over steps
        self._last_reply = 0.0  # when the last reply came (0: the loop went idle since)
        self._sent_at: list[float] = []  # when each step in flight was sent, oldest first
        self._iters: list[int] = []  # and its decode iterations (its bounds: _bound)
        self._lock_wanted = 0  # control calls waiting for the step lock (ends a pipeline)
        # progress watermark: set when the loop takes the step lock and after each step
        self.active = False  # the loop holds the step lock (a step may be in flight)
        self.last_progress = time.monotonic()
        self.in_step = 0  # number of the step in flight, 0 when none
        self.supervisor: Supervisor | None = None
        self.last_arrival = 0.0  # monotonic time the last request was queued
        self.arrived = asyncio.Event()  # set on each queued request (wakes gather)
        self.step_avg = 0.0  # moving average of a step's round trip (0: none yet)
        self.iter_avg = 0.0  # ... and of a decode iteration's share of it
        self.gathered = 0.0  # seconds idle starts waited for more requests (summed)
        # sender -> (requests it said it still holds, when): ``GenRequest.more``
        self._coming: dict[str, tuple[int, float]] = {}
        self._behind_key: tuple[int, str] | None = None
        self._behind = 0
        # reply subjects of requests that came as JSON (raw NATS clients, `nats req`): their
        # chunks go back as JSON too; -> last time seen live (pruned by heartbeats)
        self._json_replies: dict[str, float] = {}
        # coalesced requests' choices (``_coalesce``): (request id, index) -> [steps since
        # the last send, the chunk held (tokens merged) or None]
        self._held: dict[tuple[str, int], list[Any]] = {}
        self.coalesce_bytes = NATS_MAX_PAYLOAD // COALESCE_PAYLOAD_SHARE  # (start: the server's)

    # ------------------------------------------------------------------ bus side

    async def start(self, svc: Service) -> None:
        subj = self.engine.subjects.gen
        # a step message (its rows' block tables, token ids and sample specs) must fit what
        # one message may carry (Scheduler.fit)
        payload = getattr(self.engine.bus, "max_payload", NATS_MAX_PAYLOAD)
        self.sched.fit(payload)
        self.coalesce_bytes = payload // COALESCE_PAYLOAD_SHARE
        # a request its API stopped waiting for (Rollbus-Deadline) is not queued
        await self.engine.bus.subscribe(subj, self.on_gen, queue="engine", deadline=True)
        await self.engine.bus.subscribe(subj + ".cancel", self.on_cancel)

    def background(self, sup: Supervisor) -> None:
        self.supervisor = sup
        sup.start("step_loop", self.loop, self.on_loop_error)
        sup.start("heartbeats", self.heartbeats)
        sup.start("reply_probe", self.probe_replies)

    async def on_gen(self, msg: Msg) -> None:
        """Queue a request, acknowledged by a first heartbeat, or refuse it with one error
        chunk. Anything may arrive here over raw NATS: nothing in it can fail the loop."""
        if not msg.reply:
            return
        rid = (msg.headers or {}).get(REQUEST_ID, "")  # a refusal names the request too
        if not is_msgpack_map(msg.data):  # a raw client's JSON (or junk): answered in JSON
            self._json_replies[msg.reply] = time.monotonic()
        try:
            if bad := unreadable_deadline(msg.headers or {}):  # not queued (Bus._expired)
                refused = Refused(BAD_REQUEST, f"{bad}: not unix epoch milliseconds", DEADLINE)
                refused.request_id = peek_request_id(msg.data)  # the refusal names it
                raise refused
            gen = self.admit_request(msg.data)
            rid = gen.request_id
            self.sched.add(gen, msg.reply)
        except Refused as e:
            rid = e.request_id or rid
            chunk = m.GenChunk(
                rid,
                finish_reason="error",
                error_code=e.code,
                error_message=e.message,
                error_param=e.param,
            )
            await self._send(msg.reply, chunk)
            self._json_replies.pop(msg.reply, None)
            return
        # queued; the version lets a request that ends with no token still name one
        await self._send(
            msg.reply, m.GenChunk(rid, heartbeat=True, version=self.engine.state.weight_version)
        )
        self.last_arrival = time.monotonic()
        # the sender's connection (its inbox prefix): how many more it holds right now
        self._coming[msg.reply.rpartition(".")[0]] = (gen.more, self.last_arrival)
        self.arrived.set()
        self.work.set()

    def admit_request(self, data: bytes) -> m.GenRequest:
        """Decode and check one ``gen`` message against every limit; raises ``Refused``."""
        if not is_msgpack_map(data) and (dup := jsonkeys.duplicate_in(data)):
            # which of the two counts is undefined (RFC 8259 §4): never the last, silently.
            # Its path is the client's to choose (keys of any length): cut as over HTTP, not
            # echoed whole (a reply as large as the request, near max_payload)
            where = dup[:256]
            refused = Refused(
                BAD_REQUEST, f"bad request: '{where}' is given more than once (duplicate key)",
                where,
            )  # fmt: skip
            refused.request_id = peek_request_id(data)
            raise refused
        try:
            gen = decode_gen(data)
        except msgspec.ValidationError as e:
            param = (m.error_param(e) or "")[:256]  # an unknown field's name: the client's
            refused = Refused(BAD_REQUEST, m.clip(f"bad request: {e}"), param)
            refused.request_id = peek_request_id(data)
            raise refused from None
        except Exception as e:  # noqa: BLE001 - neither msgpack nor JSON
            raise Refused(BAD_REQUEST, f"bad request: not a GenRequest: {e}") from None
        try:
            gen.request_id.encode()
        except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800") cannot go back out
            raise Refused(BAD_REQUEST, "request_id is not valid unicode", "request_id") from None
        try:
            return self._admit(gen)
        except Refused as e:
            e.request_id = gen.request_id
            raise

    def _admit(self, gen: m.GenRequest) -> m.GenRequest:
        s = self.engine.settings
        if gen.n > s.max_n:
            raise Refused(BAD_REQUEST, f"n is {gen.n}; the limit is {s.max_n}", "n")
        for name in ("prompt_token_ids", "stop_token_ids", "allowed_token_ids"):
            if any(t >= self.vocab_size for t in getattr(gen, name) or ()):
                raise Refused(
                    BAD_REQUEST, f"{name}: token id out of the vocabulary ({self.vocab_size})", name
                )
        if any(t >= self.vocab_size for w in gen.bad_words or () for t in w):
            raise Refused(
                BAD_REQUEST, f"bad_words: token id out of the vocabulary ({self.vocab_size})",
                "bad_words",
            )  # fmt: skip
        if gen.min_tokens > gen.max_tokens:
            raise Refused(
                BAD_REQUEST,
                f"min_tokens ({gen.min_tokens}) is more than max_tokens ({gen.max_tokens})",
                "min_tokens",
            )
        bias = gen.logit_bias
        if bias is not None:
            if len(bias.ids) != len(bias.values):
                why = f"ids and values differ in length ({len(bias.ids)}, {len(bias.values)})"
            elif any(t >= self.vocab_size for t in bias.ids):
                why = f"token id out of the vocabulary ({self.vocab_size})"
            elif len(set(bias.ids)) != len(bias.ids):
                why = "a token id appears twice"
            else:
                why = ""
            if why:
                raise Refused(BAD_REQUEST, f"logit_bias: {why}", "logit_bias")
        if gen.request_id in self.sched.requests:
            raise Refused(
                BAD_REQUEST, f"request_id {gen.request_id!r} is already running", "request_id"
            )
        if refused := self.sched.check(gen):
            raise Refused(BAD_REQUEST, *refused)
        if self.sched.num_queued >= s.max_waiting:
            raise Refused(
                TOO_MANY_REQUESTS,
                f"the engine queue is full ({s.max_waiting} requests waiting, "
                "ROLLBUS_MAX_WAITING); retry later",
            )
        return gen

    async def on_cancel(self, msg: Msg) -> None:
        try:
            if jsonkeys.duplicate_in(msg.data):  # which request? none is cancelled
                raise msgspec.ValidationError("a key given twice")
            rid = m.json_decode(msg.data, type=m.GenCancel).request_id
        except msgspec.MsgspecError:
            _flood.warning(
                "cancel", "ignored a malformed gen.cancel message (%d bytes)", len(msg.data)
            )
            return
        self._cancels.append(rid)
        self.work.set()

    async def probe_replies(self) -> None:
        """Cancel requests whose reply inbox is gone (their API died): ``orphans``."""

        def heartbeat(reply: str, rid: str) -> bytes:
            chunk = m.GenChunk(rid, heartbeat=True)
            return m.json_encode(chunk) if reply in self._json_replies else m.pack(chunk)

        def cancel(rid: str) -> None:
            self._cancels.append(rid)
            self.work.set()

        await orphans.probe_loop(
            self.engine.bus, lambda: self.sched.requests.values(), heartbeat, cancel, self._batched
        )

    def _batched(self, req: Request) -> bool:
        """Its chunks go in its inbox prefix's batch message (a JSON client's never do)."""
        return req.gen.batch and req.reply not in self._json_replies

    async def _send(self, reply: str, chunk: m.GenChunk) -> None:
        data = m.json_encode(chunk) if reply in self._json_replies else m.pack(chunk)
        await self.engine.bus.publish(reply, data, headers={REQUEST_ID: chunk.request_id})

    def _chunk(self, out: Output) -> m.GenChunk:
        seq = out.seq
        if out.error:
            code, why = out.error
            return m.GenChunk(
                seq.req.request_id,
                seq.index,
                finish_reason="error",
                error_code=code,
                error_message=why,
            )
        return m.GenChunk(
            seq.req.request_id,
            seq.index,
            [] if out.token is None else [out.token],
            None if out.logprob is None or not seq.req.gen.logprobs else [out.logprob],
            seq.spans[-1].version if seq.spans else self.engine.state.weight_version,
            out.finish_reason,
            list(seq.spans) if out.finish_reason else None,
            top=[out.top] if out.top is not None and seq.req.gen.top_logprobs else None,
        )

    async def _publish(self, outputs: list[Output]) -> None:
        """The chunks of a step: a request that asked ``batch`` (the API's) has its chunk
        in one message per reply inbox with the others' (``shared.bus`` batches); one that
        asked ``coalesce`` has its tokens held and sent every ``COALESCE_STEPS`` steps
        (the first and the last at once); any other gets one message per chunk."""
        batches: dict[str, list[BatchItem]] = {}
        for req, chunk in self._chunks(outputs):
            chunks = self._coalesce(chunk) if req.gen.coalesce else [chunk]
            if not chunks:
                continue  # held
            if self._batched(req):
                subject, token = batch_subject(req.reply)
                items = batches.setdefault(subject, [])
                items += [(token, c.request_id, m.pack(c)) for c in chunks]
                continue
            for c in chunks:
                await self._send(req.reply, c)
        # a batch past the server's max_payload (thousands of choices aborted at once)
        # goes as several messages: one publish of it would fail and lose every chunk
        limit = getattr(self.engine.bus, "max_payload", NATS_MAX_PAYLOAD)
        for subject, items in batches.items():
            for data in pack_batches(items, limit):
                await self.engine.bus.publish(subject, data)

    def _chunks(self, outputs: list[Output]) -> list[tuple[Request, m.GenChunk]]:
        """The chunks of ``outputs``: one per choice, with every token a step of several
        decode iterations gave it (in order), the way one-token steps would have sent
        them one by one."""
        chunks: list[tuple[Request, m.GenChunk]] = []
        last: dict[tuple[str, int], m.GenChunk] = {}  # each choice's chunk so far
        for out in outputs:
            chunk = self._chunk(out)
            key = (chunk.request_id, chunk.index)
            held = last.get(key)
            if held is not None and _mergeable(held, chunk):
                _merge(held, chunk)
                continue
            last[key] = chunk
            chunks.append((out.seq.req, chunk))
        return chunks

    def _coalesce(self, chunk: m.GenChunk) -> list[m.GenChunk]:
        """What to send now of a coalesced request's choice, given its new ``chunk``:
        its first chunk, an end or an error at once (with every token held before it);
        else the tokens held are merged and go out every ``COALESCE_STEPS`` steps (or once
        they take ``COALESCE_PAYLOAD_SHARE``'s part of max_payload), or before a chunk of
        another weight version (a chunk has one version)."""
        key = (chunk.request_id, chunk.index)
        entry = self._held.get(key)
        if entry is None or chunk.error_code:
            if entry is None and chunk.finish_reason is None:
                self._held[key] = [0, None]  # the first: at once (time to first token)
            else:
                self._held.pop(key, None)
            return [chunk]
        out: list[m.GenChunk] = []
        held = entry[1]
        if held is not None and held.version != chunk.version:
            out.append(held)
            held = None
        if held is None:
            held = chunk
        else:
            _merge(held, chunk)
        entry[0] += 1
        if held.finish_reason is not None:
            del self._held[key]
            out.append(held)
        elif entry[0] >= COALESCE_STEPS or _held_bytes(held) >= self.coalesce_bytes:
            entry[0], entry[1] = 0, None
            out.append(held)
        else:
            entry[1] = held
        return out

    async def _end(self, seqs: list[Seq]) -> None:
        await self._publish([Output(s, None, None, s.finish_reason) for s in seqs])

    # ------------------------------------------------------------------ loop

    async def loop(self) -> None:
        while True:
            await self.work.wait()
            await self.gather()
            async with self.step_lock:
                self.active, self.last_progress = True, time.monotonic()
                try:
                    await self._one()
                finally:
                    self.active, self.in_step = False, 0
            await asyncio.sleep(0)  # let control handlers take the lock between steps

    def gather_window(self) -> tuple[float, float, float]:
        """(most, quiet, held) seconds an idle start waits: ``ROLLBUS_ADMIT_WAIT_MS``, at
        most half a step's round trip (a later arrival costs the batch about one step);
        it ends once no request has come for ``ROLLBUS_ADMIT_QUIET_MS`` (or
        ``QUIET_STEP_SHARE`` of a step when that is longer: see there) — unless a sender
        said it holds more (``GenRequest.more``: a burst the API is still tokenizing and
        sending): those are waited for up to ``ROLLBUS_ADMIT_WAIT_MS`` (``held``)."""
        s = self.engine.settings
        held = getattr(s, "admit_wait_ms", 0.0) / 1e3
        most = min(held, self.step_avg / 2) if self.step_avg else held
        quiet = getattr(s, "admit_quiet_ms", 0.0) / 1e3
        if quiet > 0:  # 0: start as soon as no sender holds more, as set
            quiet = max(quiet, QUIET_STEP_SHARE * self.step_avg)
        return most, min(quiet, most), held

    def _more_coming(self, now: float, held: float) -> bool:
        return any(n > 0 and now - t < held for n, t in self._coming.values())

    async def gather(self) -> None:
        """Requests arriving together start together: when nothing runs and requests
        wait, wait a little for more, so their prompts share one prefill step and their
        decodes run in lockstep (each later group would cost every request of the batch
        one more step). Never while anything runs: a running batch is not delayed."""
        most, quiet, held = self.gather_window()
        t0 = time.monotonic()
        while (
            most > 0
            and self.admit
            and self.run
            and not self.sched.running
            and not self._cancels
            and 0 < len(self.sched.waiting) < self.sched.max_batch
        ):
            now = time.monotonic()
            if self._more_coming(now, held):
                left = t0 + held - now
            else:
                left = min(t0 + most, self.last_arrival + quiet) - now
            if left <= 0:
                break
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):  # woken by each arrival, to look again
                await asyncio.wait_for(self.arrived.wait(), left)
        self._coming.clear()  # what they said is about the requests now admitted
        self.gathered += time.monotonic() - t0

    async def _take_cancels(self) -> None:
        for rid in self._cancels:
            await self._end(self.sched.abort(rid, "abort"))
        self._cancels.clear()

    def _plan(self, ahead: bool = False) -> Plan | None:
        bound, behind = self._staleness_gate()
        # several decode iterations per step unless a control call waits for the lock:
        # it gets it after one iteration of each step in flight
        steps = 1 if self._lock_wanted else getattr(self.engine.settings, "decode_steps", 1)
        return self.sched.schedule(
            admit=self.admit, run=self.run, behind=behind, max_staleness=bound, ahead=ahead,
            steps=steps,
        )  # fmt: skip

    def _most_iters(self) -> int:
        """The most decode iterations of a step in flight (1 when none is)."""
        return max(self._iters, default=1)

    def _bound(self, base: float, iters: int) -> float:
        """``base``, a bound of one step (the reply wait, ``STALL_S``), for a step of
        ``iters`` decode iterations: each later iteration adds ``ITER_MARGIN`` times a
        recent iteration's time (``iter_avg``), and at most ``base``. A step of several
        is never taken for stalled while its iterations are as quick as steps, and a
        stopped rank is still named within about ``base``, not ``iters`` times it."""
        if iters <= 1:
            return base
        each = min(base, ITER_MARGIN * self.iter_avg) if self.iter_avg else base
        return base + (iters - 1) * each

    def _may_pipeline(self) -> bool:
        """Send the next step before this one's reply: the setting is on, the gates are
        open and nothing waits for the step lock (pause, update_weights, sleep...)."""
        return (
            getattr(self.engine.settings, "step_pipeline", False)
            and self.run
            and not self._lock_wanted
        )

    async def _one(self) -> None:
        """One step, or a run of pipelined steps: while step N is in flight, N+1 is
        planned from what N will leave and sent, so the ranks go from one to the next
        without waiting for the engine; the run ends (N's reply applied last) as soon as
        anything needs the lock or no step can be planned ahead. Every step sent is
        answered before the lock is released; when one fails, every live request ends
        with its error at once and the steps sent after it are settled (:meth:`_settle`)
        before the lock is released."""
        await self._take_cancels()
        plan = self._plan()
        if plan is None:
            self._last_reply = 0.0
            self.work.clear()
            if not self.sched.running:
                self.drained.set()
            return
        self.drained.clear()
        # replaced, never changed in place, by a reconcile
        pids: dict[int, int] = getattr(self.engine, "rank_pids", {})
        # the ranks this run's steps go to for sure: a rank already gone now (restarted,
        # not yet reconciled) is another process, which may well answer
        view = getattr(getattr(self.engine, "ranks", None), "view", None)
        stale = set(view.gone(pids)) if view is not None and pids else set()
        targets = {r: p for r, p in pids.items() if r not in stale}
        flying: list[Sent] = []  # sent, reply not taken yet, oldest first
        nxt: tuple[Plan, Sent] | None = None
        try:
            sent = await self._send_step(plan, self._may_pipeline())
            flying.append(sent)
            while True:
                # only after a step whose tokens the ranks keep (decided when it was sent)
                keep = plan.step.keep
                ahead = self._plan(ahead=True) if keep and self._may_pipeline() else None
                if ahead is not None:
                    nxt = (ahead, await self._send_step(ahead, True))
                    flying.append(nxt[1])
                try:
                    outputs = await self._step_reply(plan, sent, targets)
                finally:
                    flying.remove(sent)  # answered, or failed (its late reply is dropped)
                self.last_progress = time.monotonic()
                await self._publish(outputs)
                if nxt is None:
                    return
                (plan, sent), nxt = nxt, None
                await self._take_cancels()
        except ControlError as e:
            await self._failed(self._naming_silent_ranks(e, pids), flying, pids)
        except Exception as e:
            # the loop fails (and restarts); its requests hear it now, not after the settle
            why = f"step loop failed: {type(e).__name__}: {e}"
            await self._failed(ControlError(UNAVAILABLE, why), flying, pids)
            raise
        finally:
            for left in flying:  # not settled (cancelled, or past the bound): dropped
                left.drop()
            self._sent_at.clear()
            self._iters.clear()

    async def _failed(self, err: ControlError, flying: list[Sent], pids: dict[int, int]) -> None:
        """A step failed: end every live request with ``err``, then settle the steps
        still in flight (the caller holds the step lock)."""
        try:
            await self._fail_all(err)
        finally:
            await self._settle(flying, pids)

    async def _settle(self, flying: list[Sent], pids: dict[int, int]) -> None:
        """After a failed step, the steps sent after it (pipelined) may still run on the
        ranks: wait for their replies (dropped: their requests have failed) before the
        step lock is released, so that no control call (update_weights, sleep, wakeup,
        pause) and no next step meets them. Bounded: at most ``CONTROL_TIMEOUT_S`` from
        now, and over as soon as a rank they went to is known gone (its process exited,
        or it was restarted: no reply can come) or the NATS connection was lost."""
        if not flying:
            return
        self.last_progress = time.monotonic()  # the failure was handled; this is bounded
        futs = [s.fut for s in flying]
        t = self._bound(self.engine.settings.control_timeout_s, self._most_iters())
        deadline = time.monotonic() + t
        view = getattr(getattr(self.engine, "ranks", None), "view", None)
        while True:
            for f in futs:
                if f.done() and not f.cancelled():
                    f.exception()  # retrieved: a lost connection's error is expected here
            waiting = [f for f in futs if not f.done()]
            if not waiting:
                return
            gone = view.gone(pids) if view is not None and pids else []
            left = deadline - time.monotonic()
            if gone or left <= 0:
                why = f"ranks {gone} are gone" if gone else f"no reply within {t:g}s"
                log.warning("%d steps sent after the failed one not settled: %s", len(waiting), why)
                return
            await asyncio.wait(waiting, timeout=min(left, SETTLE_POLL_S))

    def _naming_silent_ranks(self, e: ControlError, pids: dict[int, int]) -> ControlError:
        """A step without a reply (only rank 0 answers, and it waits in the all-reduce for
        a peer that is stopped or gone) names the ranks the engine's view has silent, or
        restarted meanwhile (another pid than the ones ``pids`` the step was sent to)."""
        view = getattr(getattr(self.engine, "ranks", None), "view", None)
        if not isinstance(e, Timeout) or view is None:
            return e
        silent, restarted = [], []
        for r in view.entries():
            if not r.get("alive"):
                silent.append(r["rank"])
            elif pids.get(r["rank"]) and r.get("pid") != pids[r["rank"]]:
                restarted.append(r["rank"])
        why = [f"ranks {silent} not answering"] if silent else []
        why += [f"ranks {restarted} restarted"] if restarted else []
        if not why:
            return e
        return ControlError(e.code, f"{e.message}: {'; '.join(why)}", e.result)

    def _staleness_gate(self) -> tuple[int | None, int]:
        """``(ROLLBUS_MAX_STALENESS, versions behind)`` for this step's admissions; the
        count is only taken when some bound exists (setting or a waiting request's)."""
        bound = getattr(self.engine.settings, "max_staleness", None)
        if bound is None and not any(
            r.gen.max_staleness is not None for r in self.sched.requests.values() if not r.started
        ):
            return None, 0
        return bound, self.behind()

    def behind(self) -> int:
        """Versions the serving one is behind the newest announced (cached per change of
        the version index or of the serving version)."""
        idx = autoupdate.index_of(self.engine)
        key = (idx.changes, self.engine.state.weight_version)
        if key != self._behind_key:
            self._behind_key = key
            self._behind = staleness.versions_behind(idx.seqs, key[1])
        return self._behind

    def staleness_report(self) -> staleness.Staleness:
        """``/v1/status`` ``staleness`` and the metrics' gauges."""
        bound = self.engine.settings.max_staleness
        behind = self.behind()
        return staleness.Staleness(
            behind=behind,
            max_staleness=bound,
            newest=autoupdate.index_of(self.engine).latest,
            serving=self.engine.state.weight_version,
            waiting=self.sched.held(behind, bound),
        )

    async def _send_step(self, plan: Plan, keep: bool) -> Sent:
        """Send one step (``keep``: the ranks keep its sampled tokens for the next)."""
        eng = self.engine
        now = time.perf_counter()
        if self._last_reply and not self._sent_at:
            self.between_seconds += now - self._last_reply
        plan.step.version = eng.state.weight_version  # no rank steps on another version
        plan.step.keep = keep
        self.in_step = self.in_step or plan.step.step
        sent = await eng.bus.send(eng.subjects.worker_step, m.pack(plan.step))
        self._sent_at.append(now)
        self._iters.append(plan.step.iters)
        return sent

    async def _step_reply(self, plan: Plan, sent: Sent, pids: dict[int, int]) -> list[Output]:
        """Wait for the reply of the oldest step sent and apply it; a rank's error, a rank
        it went to known gone, or no reply within CONTROL_TIMEOUT_S (from when the step
        before it answered) raises 503."""
        try:
            rep = await self._reply(sent, plan.step.step, pids, plan.step.iters)
        finally:
            self._iters.pop(0)
            t0 = max(self._sent_at.pop(0), self._last_reply)
            self._last_reply = time.perf_counter()
            self.in_step = plan.step.step + 1 if self._sent_at else 0
        try:
            reply = m.unpack(rep.data, type=m.StepReply)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            # not a rank's reply (a forged or corrupt message): this step fails, not the loop
            raise ControlError(
                UNAVAILABLE, f"step {plan.step.step} failed: malformed step reply: {e}"
            ) from None
        if reply.error:
            raise ControlError(UNAVAILABLE, f"step {plan.step.step} failed: {reply.error}")
        took = self._last_reply - t0
        self.step_seconds += took
        self.step_avg = took if not self.step_avg else 0.8 * self.step_avg + 0.2 * took
        per = took / plan.step.iters
        self.iter_avg = per if not self.iter_avg else 0.8 * self.iter_avg + 0.2 * per
        self.rank_seconds += reply.seconds
        self.steps += 1
        self.rows += len(plan.step.rows)
        # a step of block copies alone (a fork's, its rows all finished) runs no forward
        # pass: ``iters`` is 1 there only as the message's default
        self.iterations += plan.step.iters if plan.step.rows else 0
        return self.sched.apply(plan, reply, plan.step.version)

    async def _reply(self, sent: Sent, step: int, pids: dict[int, int], iters: int = 1) -> Reply:
        """The reply of a step in flight within ``CONTROL_TIMEOUT_S`` (for a step of
        several decode ``iters``: :meth:`_bound`); once it is late
        (``GONE_POLL_S``), a rank it was sent to that is known gone (its process exited,
        or it was restarted: ``pids`` are the processes it went to, alive when the run
        started) fails it at once, naming the rank, instead of at the timeout: no reply
        can come (rank 0 would wait in the all-reduce for a dead peer)."""
        t = self._bound(self.engine.settings.control_timeout_s, iters)
        view = getattr(getattr(self.engine, "ranks", None), "view", None)
        if view is None or not pids:
            return await sent.reply(t)
        deadline = time.monotonic() + t
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    # the late one may be the engine (stopped: the reply unread in its
                    # socket): Sent.reply's settle, on this loop's own timer
                    await self.engine.bus.settle()
                    if sent.fut.done():
                        return sent.fut.result()
                    raise Timeout(sent.subject, t)
                await asyncio.wait((sent.fut,), timeout=min(left, GONE_POLL_S))
                if sent.fut.done():
                    return sent.fut.result()
                gone = view.gone(pids)
                if gone:
                    raise ControlError(
                        UNAVAILABLE,
                        f"step {step} failed: ranks {gone} gone (process exited or restarted)",
                    )
        finally:
            sent.drop()

    async def on_loop_error(self, err: BaseException) -> None:
        """The step loop died: every live request gets 503 (the loop restarts)."""
        async with self._lock():
            if self.sched.requests:  # a failure inside a step run has ended them already
                why = f"step loop failed: {type(err).__name__}: {err}"
                await self._fail_all(ControlError(UNAVAILABLE, why))
            else:
                self.sched.reset_blocks()
        self.work.set()

    def stall(self) -> str | None:
        """Why the step loop counts as stalled (None when it is not): it holds the step
        lock — work to do, a step maybe in flight — without progress for ``STALL_S``, or
        it sits idle that long while requests wait and the gates are open (nothing it
        can schedule: e.g. KV blocks lost)."""
        age = time.monotonic() - self.last_progress
        limit = self.engine.settings.stall_s
        if age < (self._bound(limit, self._most_iters()) if self.active else limit):
            return None
        if not self.active:
            # requests held by the staleness bound wait by design, like those of a pause
            bound, behind = self._staleness_gate()
            waiting = len(self.sched.requests) - self.sched.held(behind, bound)
            if self.admit and self.run and waiting > 0:
                return f"step loop stalled: idle for {age:.0f}s while {waiting} requests wait"
            return None
        where = f" (step {self.in_step} in flight)" if self.in_step else ""
        return (
            f"step loop stalled: no progress for {age:.0f}s{where} while "
            f"{len(self.sched.requests)} requests wait"
        )

    async def shutdown(self) -> None:
        """The engine is stopping (SIGTERM), its tasks already cancelled: every live
        request hears it now (503) instead of at its API's idle timeout (CONTROL_TIMEOUT_S
        after the last heartbeat). No lock: no step will be sent any more."""
        if self.sched.requests:
            await self._fail_all(ControlError(UNAVAILABLE, "the engine is shutting down"))

    async def _fail_all(self, err: ControlError) -> None:
        """End every live request with ``err`` (the caller holds the step lock)."""
        ended = self.sched.abort(None, "error")
        n = len({s.req.request_id for s in ended})
        log.error("%s: failing %d live requests", err.message, n)
        self.sched.reset_blocks()
        self._held.clear()  # every request ends here
        for seq in ended:
            chunk = m.GenChunk(
                seq.req.request_id,
                seq.index,
                finish_reason="error",
                error_code=err.code,
                error_message=err.message,
            )
            await self._send(seq.req.reply, chunk)
        await self.engine.event("step_error", {"error": err.message, "requests": len(ended)})

    async def heartbeats(self) -> None:
        """Tell the API every waiting request is still alive (it may wait for a resume),
        unless the step loop is wedged: then restart it, which fails them with 503."""
        s = self.engine.settings
        while True:
            # the API gives a request up after CONTROL_TIMEOUT_S of silence
            await asyncio.sleep(min(HEARTBEAT_S, s.stall_s, s.control_timeout_s / 3))
            if self.active and time.monotonic() - self.last_progress > (
                self._bound(s.stall_s + s.control_timeout_s, self._most_iters())
            ):
                why = self.stall() or "step loop stalled"
                if self.supervisor and self.supervisor.restart("step_loop", why):
                    continue
            if not self.active and self.sched.requests:
                self.work.set()  # a lost wakeup must not leave requests waiting
            now = time.monotonic()
            for req in list(self.sched.requests.values()):
                if req.reply in self._json_replies:
                    self._json_replies[req.reply] = now
                await self._send(req.reply, m.GenChunk(req.request_id, heartbeat=True))
            for key in [k for k in self._held if k[0] not in self.sched.requests]:
                del self._held[key]  # ended without a chunk through _publish
            for reply, seen in list(self._json_replies.items()):
                if now - seen > JSON_REPLY_TTL_S:  # its request ended long ago
                    del self._json_replies[reply]

    # ------------------------------------------------------------------ control hooks

    async def pause(self, mode: str) -> int:
        """Close the gates; returns how many requests were aborted.

        ``wait`` drains first; if requests still run after CONTROL_TIMEOUT_S it opens
        admission again and raises 503: the engine is still running, and says so."""
        if mode == "wait":
            self.admit = False
            self.work.set()
            timeout = self.engine.settings.control_timeout_s
            try:
                await asyncio.wait_for(self._drain(), timeout)
            except TimeoutError:
                self.admit = self.run = True  # the drain may have closed run: not paused
                self.work.set()
                running = len(self.sched.running)
                # none running: the drain waited for a step in flight (a rank that does
                # not answer), not for requests
                what = (
                    f"{running} requests still running"
                    if running
                    else "a step still in flight (a rank did not answer)"
                )
                raise ControlError(
                    UNAVAILABLE,
                    f"pause(wait): {what} after {timeout:g}s; not paused: the engine keeps running",
                ) from None
            return 0
        self.admit = self.run = False
        async with self._lock():  # the steps in flight complete first
            if mode == "abort":
                ended = self.sched.abort(None, "abort")
                await self._end(ended)
                return len({s.req.request_id for s in ended})
        return 0

    async def _drain(self) -> None:
        while self.sched.running:
            self.drained.clear()
            self.work.set()
            await self.drained.wait()
        # and no step in flight: a pipelined step may still be computing the extra rows
        # (dropped) of sequences that all ended in the step before it. ``run`` closes
        # under the lock: no step starts between this and pause's return (e.g. one that
        # names the finished sequences to the ranks)
        async with self._lock():
            self.run = False

    @contextlib.asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """Hold the step lock: no step is in flight meanwhile, none starts. The
        scheduler changes below must be called inside it."""
        async with self._lock():
            yield

    @contextlib.asynccontextmanager
    async def _lock(self) -> AsyncIterator[None]:
        """The step lock for a control call: while it waits, the step loop sends no step
        ahead, so a run of pipelined steps ends after the ones in flight."""
        self._lock_wanted += 1
        try:
            await self.step_lock.acquire()
        finally:
            self._lock_wanted -= 1
        try:
            yield
        finally:
            self.step_lock.release()

    def _locked(self, what: str) -> None:
        if not self.step_lock.locked():
            raise RuntimeError(f"{what} outside the step lock")

    def resume(self) -> None:
        self._locked("resume")
        if self.recompute:
            self.sched.recompute_all()
            self.recompute = False
        self.admit = self.run = True
        self.work.set()

    def drop_kv(self) -> None:
        self._locked("drop_kv")
        self.sched.reset_blocks()
        self.recompute = True

    def weights_changed(self, version: str) -> None:
        self._locked("weights_changed")
        if self.sched.running:
            self.recompute = True

    def counts(self) -> dict[str, Any]:
        return {
            **self.sched.counts(),
            "steps": self.steps,
            "admitting": self.admit,
            # where the step loop's time goes (seconds, cumulative since the engine started)
            "step_time": {
                "rows": self.rows,
                "iterations": self.iterations,
                "in_step_s": round(self.step_seconds, 4),
                "rank_s": round(self.rank_seconds, 4),
                "between_steps_s": round(self.between_seconds, 4),
                "admit_wait_s": round(self.gathered, 4),
            },
        }
