"""Executes ``rollbus.<i>.worker.step`` on a rank: one publish in, one reply out.

Every rank runs the forward pass of the step (the all-reduces need all of them);
rank 0 alone samples and replies. Sampling state (one generator per sequence) lives on
rank 0 and survives preemption; the engine names finished sequences so it is dropped.
So does each penalised sequence's :class:`TokenHistory` (its rows carry ``history``):
rank 0 records their tokens as the rows bring them — the only rank that samples, so the
only one that needs them; the other ranks get the sampled tokens, never the logits.

A step of ``iters`` > 1 runs that many decode iterations: each feeds every row the token
the iteration before sampled for it, shared from rank 0 in the same small all-reduce as
the kept tokens of pipelined steps (with rank 0's "sampling raised" flag last, so that no
rank goes on to a forward pass alone; the others then stop without a reply, so that the
engine hears rank 0's error, the cause: :class:`PeerStopped`); rank 0 samples each
iteration with the same generators and penalty records as one-token steps, and replies
once with every iteration's samples in order.

A step only some ranks received must not hang the others: steps are numbered 1, 2, ...
by the engine, so a rank that sees a gap (it missed a step its peers may be running)
refuses the step without entering a collective and replies with the error — any rank
replies on an error, so the engine learns it at once. Until it has seen (by pinging
them) that no peer is busy in a step it missed, it refuses the next ones too: its
collectives would pair with that step's and abort both processes. A smaller number
than the last one means a restarted engine: the count starts over. The :class:`Watermark` says what
the compute thread runs and since when; ``ping`` reports it, so a rank blocked in a
collective shows as stuck (``services.worker.main`` also exits past a bound).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from nats.aio.msg import Msg

from services.worker import model as mdl
from services.worker.control import Rank
from services.worker.sampling import (
    SamplingParams,
    TokenHistory,
    bad_word_bans,
    make_generator,
    sample_each,
)
from services.worker.stepcheck import StepLimits, check_step
from shared import messages as m
from shared.bus import RANK, REQUEST_ID, Bus
from shared.errors import BAD_REQUEST, INTERNAL, Timeout

log = logging.getLogger("rollbus.worker.step")

T = TypeVar("T")
QUEUED_STEPS = 2  # steps a rank takes before its replies: the one running and the next


class NoHistory(RuntimeError):
    """Rank 0 lacks tokens of a penalised sequence: its penalties cannot be applied."""


class Watermark:
    """What the rank's one compute thread runs now, and since when (monotonic)."""

    def __init__(self) -> None:
        self.job = ""
        self.since = 0.0
        self.done = 0

    def run(self, job: str, fn: Callable[..., T], *args: Any) -> T:
        self.job, self.since = job, time.monotonic()
        try:
            return fn(*args)
        finally:
            self.job = ""
            self.done += 1

    def progress(self) -> None:
        """The job made progress (a step's next decode iteration begins): ``busy_s``
        counts from now, so the bounds of a stuck step (the watchdog's, the engine's
        health check) hold per iteration, and a step of several is never taken for
        stuck while each of its iterations is as quick as a step."""
        self.since = time.monotonic()

    def busy_s(self) -> float:
        return time.monotonic() - self.since if self.job else 0.0

    def report(self) -> dict[str, Any]:
        return {"busy": self.job, "busy_s": round(self.busy_s(), 3), "jobs_done": self.done}


def _extend(reply: m.StepReply, more: m.StepReply) -> None:
    """``reply`` followed by ``more``'s samples (the next iteration's): ``top`` is empty
    or has one entry per sample, so the side without it gets empty entries."""
    if more.top and not reply.top:
        reply.top = [m.TopLogprobs([]) for _ in reply.seq_ids]
    elif reply.top and not more.top:
        more.top = [m.TopLogprobs([]) for _ in more.seq_ids]
    reply.seq_ids += more.seq_ids
    reply.tokens += more.tokens
    reply.logprobs += more.logprobs
    reply.top += more.top
    reply.failed += more.failed


class PeerStopped(RuntimeError):
    """A rank other than 0 stops a step of several decode iterations because rank 0's
    sampling raised (its flag rode the token share): rank 0 replies with the error."""


class Stepper:
    def __init__(
        self,
        state: Rank,
        bus: Bus,
        pool: ThreadPoolExecutor,
        rank: int,
        watermark: Watermark | None = None,
        peers: tuple[str, int] | None = None,
    ) -> None:
        self.state, self.bus, self.pool, self.rank = state, bus, pool, rank
        self.watermark = watermark or Watermark()
        self.peers = peers  # (ping subject of every rank, tp)
        self.generators: dict[int, np.random.Generator] = {}
        self.histories: dict[int, TokenHistory] = {}  # rank 0: the penalised sequences'
        # tokens sampled in the last step run, by sequence, when it said ``keep``: a
        # pipelined step's ``prev`` rows continue with them (every rank has them)
        self.kept: dict[int, int] = {}
        self.kept_step = -1  # the step those come from
        self._last: list[int] = []  # the last iteration's tokens per spec (run's scratch)
        self._replying: set[asyncio.Future[None]] = set()  # steps queued, reply to come
        self.last_step = 0  # last step number received (0: none yet)
        self.missed: list[tuple[int, int]] = []  # [lo, hi) ranges of steps never received

    @functools.cached_property
    def limits(self) -> StepLimits:
        kv = self.state.kv
        # positions are bounded by what a block table can address (the engine's context
        # length setting may exceed the config's max_position_embeddings)
        return StepLimits(
            self.state.cfg.vocab_size, kv.num_blocks, kv.block_size, kv.num_blocks * kv.block_size
        )

    def gap(self, step: int) -> str:
        """The error for a step that follows a gap ('' when in sequence)."""
        last, self.last_step = self.last_step, step
        if last == 0 or step <= last:  # the first step seen, or a restarted engine
            self.missed.clear()
            return ""
        if step == last + 1:
            return ""
        self.missed = [*self.missed[-7:], (last + 1, step)]
        missed = f"step {last + 1}" if step == last + 2 else f"steps {last + 1}..{step - 1}"
        return (
            f"rank {self.rank}: missed {missed} (got step {step}): a step only some ranks "
            "received; not run"
        )

    def _was_missed(self, step: int) -> bool:
        return any(lo <= step < hi for lo, hi in self.missed)

    async def blocked_peer(self) -> str:
        """Why a peer may still be inside a step this rank missed ('' when none is:
        then the missed steps are forgotten)."""
        if not self.missed or self.peers is None:
            return ""
        subject, tp = self.peers
        try:
            replies = await self.bus.scatter(subject, b"{}", expected=tp, timeout=1.0)
        except Timeout as e:
            return f"ranks {e.missing} do not answer (they may hold a step this rank missed)"
        for r, rep in sorted(replies.items()):
            busy = str(json.loads(rep.data).get("result", {}).get("busy", ""))
            head, _, num = busy.partition(" ")
            if head == "step" and num.isdigit() and self._was_missed(int(num)):
                return f"rank {r} is in step {num}, which rank {self.rank} never got"
        self.missed.clear()
        return ""

    async def on_step(self, msg: Msg) -> None:
        try:  # raw NATS reaches this subject too: refuse, reply, keep serving
            req = m.unpack(msg.data, type=m.StepRequest)
            why = check_step(req, self.limits)
        except Exception as e:  # noqa: BLE001 - not a StepRequest at all
            req, why = m.StepRequest(-1, []), f"not a step message: {e}"
        if why:
            log.warning("rank %d: refused step %d: %s", self.rank, req.step, why)
            error = f"rank {self.rank}: bad step: {why}"
        else:
            error = self.gap(req.step)
            if not error and self.missed:  # (no coroutine per step when nothing was missed)
                blocked = await self.blocked_peer()
                if blocked:
                    error = f"rank {self.rank}: step {req.step} not run: {blocked}"
            if error:
                log.error("%s", error)
        if error:
            await self._answer(msg, m.StepReply(req.step, [], [], [], error=error))
            return
        # queued on the compute thread now, behind a step still running: the handler
        # returns at once, so the next step message is read and queued meanwhile and the
        # compute thread goes from one step to the next (pipelined steps) without a hop
        # through the event loop; the reply goes out when the step is done
        while len(self._replying) >= QUEUED_STEPS:  # bounded (the engine sends 2 at most)
            await asyncio.wait(self._replying, return_when=asyncio.FIRST_COMPLETED)
        fut = asyncio.get_running_loop().run_in_executor(
            self.pool, self.watermark.run, f"step {req.step}", self.run, req
        )
        task = asyncio.ensure_future(self._reply_when_done(msg, req, fut))
        self._replying.add(task)
        task.add_done_callback(self._replying.discard)

    async def _reply_when_done(
        self, msg: Msg, req: m.StepRequest, fut: asyncio.Future[m.StepReply]
    ) -> None:
        try:
            reply = await fut
        except PeerStopped as e:
            # rank 0 answers with its own error, the cause: this one, which says nothing of
            # it, would race it to the engine (the first reply wins) and stand in its place
            log.warning("rank %d: %s (rank 0 replies why)", self.rank, e)
            return
        except Exception as e:  # the engine must learn of it, not time out
            log.exception("rank %d: step %d failed", self.rank, req.step)
            reply = m.StepReply(req.step, [], [], [], error=f"rank {self.rank}: {e!r}")
        await self._answer(msg, reply)

    async def _answer(self, msg: Msg, reply: m.StepReply) -> None:
        """Publish the step's reply. One that cannot be published (larger than the
        server's max_payload, a closed connection) is logged and counted as a callback
        error of the step subject (``ping``/``status`` ``callback_errors``, /metrics), and
        a short error reply saying so is tried instead: the engine then fails the step at
        once rather than after its timeout."""
        if not ((self.rank == 0 or reply.error) and msg.reply):
            return
        headers = {REQUEST_ID: (msg.headers or {}).get(REQUEST_ID, ""), RANK: str(self.rank)}
        data = m.pack(reply)
        try:
            await self.bus.publish(msg.reply, data, headers=headers)
            return
        except Exception as e:  # noqa: BLE001 - counted and answered below
            log.exception("rank %d: the reply of step %d was not sent", self.rank, reply.step)
            errors = self.bus.callback_errors
            errors[msg.subject] = errors.get(msg.subject, 0) + 1
            why = f"rank {self.rank}: its reply ({len(data)} bytes) could not be sent: {e!r}"
        try:
            short = m.StepReply(reply.step, [], [], [], error=why[:1000])
            await self.bus.publish(msg.reply, m.pack(short), headers=headers)
        except Exception as e:  # noqa: BLE001 - the engine times out; counted above
            log.error(
                "rank %d: the error reply of step %d was not sent either: %r",
                self.rank,
                reply.step,
                e,
            )

    def run(self, req: m.StepRequest) -> m.StepReply:
        t0 = time.perf_counter()
        st = self.state
        # only the step just before (by number) may be referred to: a step refused or
        # missed in between breaks the chain
        kept = self.kept if self.kept_step == req.step - 1 else {}
        self.kept, self.kept_step = {}, -1
        for seq_id in req.finished:
            self.generators.pop(seq_id, None)
            self.histories.pop(seq_id, None)
        if req.version and req.version != st.weights.version:
            # e.g. a restarted rank on the model dir's version, not yet brought to the
            # engine's: never serve a version alone
            raise RuntimeError(f"serves {st.weights.version!r}, the engine {req.version!r}")
        if not req.rows and not req.copies:
            return m.StepReply(req.step, [], [], [], seconds=time.perf_counter() - t0)
        if st.weights.current is None or not st.kv.allocated or st.model is None:
            raise RuntimeError("weights or KV cache are asleep")
        for src, dst in req.copies:
            for t in (*st.kv.keys, *st.kv.values):
                t[dst] = t[src]
        if not req.rows:
            return m.StepReply(req.step, [], [], [], seconds=time.perf_counter() - t0)
        rows = req.rows
        new = [self._tokens(r, kept) for r in rows]
        reply = self._iteration(req, rows, new, req.iters == 1 and req.keep, req.iters > 1)
        failed = {f[0] for f in reply.failed}
        for it in range(1, req.iters):
            # the next iteration's rows: each continues with the token the last one
            # sampled for it (every rank has it: shared at the end of the iteration); a
            # failed sample's -1 becomes 0, its sequence is not sampled again
            new = [[max(t, 0)] for t in self._last]
            rows = [
                m.StepRow(r.seq_id, t, r.start_pos + r.num_new, r.block_table, r.sample,
                          history=r.history)
                for r, t in zip(rows, new, strict=True)
            ]  # fmt: skip
            last = it == req.iters - 1
            self.watermark.progress()
            more = self._iteration(req, rows, new, last and req.keep, not last, failed)
            _extend(reply, more)
            failed.update(f[0] for f in more.failed)
        if self.rank == 0:
            reply.seconds = time.perf_counter() - t0
        return reply

    def _iteration(
        self,
        req: m.StepRequest,
        rows: list[m.StepRow],
        new: list[list[int]],
        keep: bool,
        more: bool,
        skip: set[int] | frozenset[int] = frozenset(),
    ) -> m.StepReply:
        """One forward pass of ``rows`` (their new tokens ``new``) and rank 0's samples;
        ``self._last``: the token sampled per row's spec, on every rank when shared (``more``:
        another iteration of the step follows, or ``keep``: the next step continues with
        them, and they are kept). ``skip``: sequences not sampled (their sampling failed
        before). When rank 0's sampling raises and ``more``, every rank learns it in the
        share and stops: none goes on to a forward pass its peers do not run."""
        st = self.state
        assert st.model is not None
        if self.rank == 0:
            for r, toks in zip(rows, new, strict=True):
                if r.history:  # the penalised sequences only: nothing for the others
                    h = self.histories.get(r.seq_id)
                    if h is None:
                        h = self.histories[r.seq_id] = TokenHistory()
                    h.record(r.start_pos, toks)
        batch = mdl.Batch(
            token_ids=new,
            start_pos=[r.start_pos for r in rows],
            block_tables=[r.block_table for r in rows],
        )
        logits = st.model.forward(st.weights.current, st.kv, batch)
        specs = [(i, spec) for i, r in enumerate(rows) for spec in r.sample]
        reply = m.StepReply(req.step, [], [], [])
        tokens = [0] * len(specs)  # what rank 0 sampled, per spec (-1: its sampling failed)
        raised = True
        try:
            if self.rank == 0 and specs:
                todo = [(i, s) for i, s in specs if s.seq_id not in skip] if skip else specs
                reply, got = self._sample(req, rows, logits, todo, new)
                tokens = got if todo is specs else self._by_spec(specs, todo, got)
            raised = False
        finally:
            # every rank, even when sampling raised: no rank waits alone
            if more and specs:  # rank 0's "stop" rides last (the others add 0)
                out = st.model.share_tokens([*tokens, int(raised and self.rank == 0)])
                tokens, stop = out[:-1], out[-1]
            elif keep and specs:
                tokens, stop = st.model.share_tokens(tokens), 0
            else:
                stop = 0
            self._last = tokens
            if keep and specs:
                self.kept = {s.seq_id: t for (_, s), t in zip(specs, tokens, strict=True)}
                self.kept_step = req.step
        if stop:  # rank 0 raised (and replies with its error); its peers stop here too
            raise PeerStopped(f"step {req.step}: rank 0's sampling failed: not run further")
        return reply

    @staticmethod
    def _by_spec(
        specs: list[tuple[int, m.SamplingSpec]],
        todo: list[tuple[int, m.SamplingSpec]],
        got: list[int],
    ) -> list[int]:
        """``got`` (per spec of ``todo``) per spec of ``specs``; -1 for the others."""
        by_seq = {s.seq_id: t for (_, s), t in zip(todo, got, strict=True)}
        return [by_seq.get(s.seq_id, -1) for _, s in specs]

    @staticmethod
    def _tokens(row: m.StepRow, kept: dict[int, int]) -> list[int]:
        """The row's new tokens: ``token_ids``, then for ``prev`` the one kept from the
        step before (a failed sample's -1 becomes 0: the engine drops what it gives)."""
        if not row.prev:
            return row.token_ids
        tok = kept.get(row.seq_id)
        if tok is None:  # the same on every rank (kept tokens are shared): all refuse
            raise RuntimeError(
                f"sequence {row.seq_id} continues with a token sampled in the step before, "
                "which this rank did not keep"
            )
        return [*row.token_ids, max(tok, 0)]

    def _sample(
        self,
        req: m.StepRequest,
        rows: list[m.StepRow],
        logits: Any,
        specs: list[tuple[int, m.SamplingSpec]],
        new: list[list[int]] | None = None,
    ) -> tuple[m.StepReply, list[int]]:
        """Rank 0: sample every spec; the reply, and the token per spec (-1: failed)."""
        host = logits.numpy()
        # a bad sampling spec fails its own sequence only (reported in ``failed``)
        good: list[tuple[int, m.SamplingSpec, SamplingParams]] = []
        failed: list[tuple[int, int, str]] = []
        for row, s in specs:
            try:
                bias = s.logit_bias
                if bias and bias.ids and max(bias.ids) >= host.shape[-1]:
                    raise ValueError(f"logit_bias: token id beyond the logits ({host.shape[-1]})")
                pen = s.penalties
                seen, counts = self._penalty_view(rows[row], s) if pen else ((), ())
                p = SamplingParams(
                    s.temperature,
                    s.top_p,
                    s.top_k,
                    s.seed,
                    s.logprobs,
                    s.top_logprobs,
                    bias_ids=bias.ids if bias else (),
                    bias_values=bias.values if bias else (),
                    ban_ids=self._bans(rows[row], s, new[row] if new else None),
                    presence_penalty=pen.presence if pen else 0.0,
                    frequency_penalty=pen.frequency if pen else 0.0,
                    repetition_penalty=pen.repetition if pen else 1.0,
                    seen_ids=seen,
                    output_counts=counts,
                    allowed_ids=(s.limits.allowed or ()) if s.limits else (),
                    min_p=s.limits.min_p if s.limits else 0.0,
                )
            except NoHistory as e:
                failed.append((s.seq_id, INTERNAL, str(e)))
                continue
            except (ValueError, TypeError) as e:
                failed.append((s.seq_id, BAD_REQUEST, f"bad sampling parameters: {e}"))
                continue
            good.append((row, s, p))
        results = sample_each(
            host[[r for r, _, _ in good]] if good else host[:0],
            [p for _, _, p in good],
            [self._generator(s) for _, s, _ in good],
        )
        seq_ids: list[int] = []
        tokens: list[int] = []
        logprobs: list[float] = []
        top: list[m.TopLogprobs] = []  # stays empty unless a spec asked for alternatives
        for (_, s, _), res in zip(good, results, strict=True):
            if isinstance(res, Exception):
                failed.append((s.seq_id, INTERNAL, f"sampling failed: {res!r}"))
                continue
            if res.top is not None and len(top) < len(seq_ids):
                top += [m.TopLogprobs([]) for _ in range(len(seq_ids) - len(top))]
            seq_ids.append(s.seq_id)
            tokens.append(res.token)
            logprobs.append(res.logprob)
            if res.top is not None:
                top.append(m.TopLogprobs(res.top[0].tolist(), res.top[1].astype("<f4").tobytes()))
            elif top:
                top.append(m.TopLogprobs([]))
        by_seq = dict(zip(seq_ids, tokens, strict=True))
        reply = m.StepReply(req.step, seq_ids, tokens, logprobs, failed=failed, top=top)
        return reply, [by_seq.get(s.seq_id, -1) for _, s in specs]

    @staticmethod
    def _bans(row: m.StepRow, spec: m.SamplingSpec, new: list[int] | None) -> Sequence[int]:
        """The ids ``spec`` may not sample: its ``ban`` (min_tokens, single-token bad
        words) and the multi-token bad words the output's end completes (the engine's
        tail, plus the token a step in flight sampled: the last of ``new`` on a ``prev``)."""
        lim = spec.limits
        if lim is None or not lim.bad_words:
            return spec.ban or ()
        tail = list(lim.tail or ())
        if row.prev and new:
            tail.append(new[-1])
        return [*(spec.ban or ()), *bad_word_bans(lim.bad_words, tail)]

    def _penalty_view(self, row: m.StepRow, spec: m.SamplingSpec) -> tuple[np.ndarray, np.ndarray]:
        """The ids and output counts ``spec``'s penalties act on: from the record of
        ``row``'s sequence (another choice sampling from its prompt gets a copy of it)."""
        assert spec.penalties is not None
        end = row.start_pos + row.num_new  # the positions before the sampled one
        if not row.history:
            raise ValueError("penalties: the row does not carry its history")
        if not 0 <= spec.penalties.prompt_len <= end:
            raise ValueError(f"penalties: prompt_len {spec.penalties.prompt_len} beyond {end}")
        h = self.histories.get(row.seq_id)
        if h is None or h.lost or len(h) != end:
            raise NoHistory(
                f"penalties: rank 0 has not seen every token of sequence {row.seq_id} "
                f"({0 if h is None else len(h)} of {end}; it restarted?): not sampled"
            )
        if spec.seq_id != row.seq_id:  # a choice forking from this prompt: its own record
            h = self.histories[spec.seq_id] = h.copy()
        return h.penalty_view(spec.penalties.prompt_len)

    def _generator(self, spec: m.SamplingSpec) -> np.random.Generator:
        gen = self.generators.get(spec.seq_id)
        if gen is None:
            gen = self.generators[spec.seq_id] = make_generator(spec.seed, spec.salt)
        return gen
