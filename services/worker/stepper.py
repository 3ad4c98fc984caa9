"""Executes ``rollbus.<i>.worker.step`` on a rank: one publish in, one reply out.

Every rank runs the forward pass of the step (the all-reduces need all of them);
rank 0 alone samples and replies. Sampling state (one generator per sequence) lives on
rank 0 and survives preemption; the engine names finished sequences so it is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from nats.aio.msg import Msg

from services.worker import model as mdl
from services.worker.control import Rank
from services.worker.sampling import SamplingParams, make_generator, sample_each
from services.worker.stepcheck import StepLimits, check_step
from shared import messages as m
from shared.bus import REQUEST_ID, Bus
from shared.errors import BAD_REQUEST, INTERNAL

log = logging.getLogger("rollbus.worker.step")


class Stepper:
    def __init__(self, state: Rank, bus: Bus, pool: ThreadPoolExecutor, rank: int) -> None:
        self.state, self.bus, self.pool, self.rank = state, bus, pool, rank
        self.generators: dict[int, np.random.Generator] = {}
        kv = state.kv
        # positions are bounded by what a block table can address (the engine's context
        # length setting may exceed the config's max_position_embeddings)
        self.limits = StepLimits(
            state.cfg.vocab_size, kv.num_blocks, kv.block_size, kv.num_blocks * kv.block_size
        )

    async def on_step(self, msg: Msg) -> None:
        try:  # raw NATS reaches this subject too: refuse, reply, keep serving
            req = m.unpack(msg.data, type=m.StepRequest)
            why = check_step(req, self.limits)
        except Exception as e:  # noqa: BLE001 - not a StepRequest at all
            req, why = m.StepRequest(-1, []), f"not a step message: {e}"
        if why:
            log.warning("rank %d: refused step %d: %s", self.rank, req.step, why)
            reply = m.StepReply(req.step, [], [], [], error=f"rank {self.rank}: bad step: {why}")
        else:
            loop = asyncio.get_running_loop()
            try:
                reply = await loop.run_in_executor(self.pool, self.run, req)
            except Exception as e:  # the engine must learn of it, not time out
                log.exception("rank %d: step %d failed", self.rank, req.step)
                reply = m.StepReply(req.step, [], [], [], error=f"rank {self.rank}: {e!r}")
        if self.rank == 0 and msg.reply:
            headers = {REQUEST_ID: (msg.headers or {}).get(REQUEST_ID, "")}
            await self.bus.publish(msg.reply, m.pack(reply), headers=headers)

    def run(self, req: m.StepRequest) -> m.StepReply:
        t0 = time.perf_counter()
        st = self.state
        for seq_id in req.finished:
            self.generators.pop(seq_id, None)
        if not req.rows and not req.copies:
            return m.StepReply(req.step, [], [], [], seconds=time.perf_counter() - t0)
        if st.weights.current is None or not st.kv.allocated or st.model is None:
            raise RuntimeError("weights or KV cache are asleep")
        for src, dst in req.copies:
            for t in (*st.kv.keys, *st.kv.values):
                t[dst] = t[src]
        if not req.rows:
            return m.StepReply(req.step, [], [], [], seconds=time.perf_counter() - t0)
        batch = mdl.Batch(
            token_ids=[r.token_ids for r in req.rows],
            start_pos=[r.start_pos for r in req.rows],
            block_tables=[r.block_table for r in req.rows],
        )
        logits = st.model.forward(st.weights.current, st.kv, batch)
        if self.rank != 0:
            return m.StepReply(req.step, [], [], [])
        rows, specs = [], []
        for i, r in enumerate(req.rows):
            for spec in r.sample:
                rows.append(i)
                specs.append(spec)
        if not specs:
            return m.StepReply(req.step, [], [], [], seconds=time.perf_counter() - t0)
        host = logits.numpy()
        # a bad sampling spec fails its own sequence only (reported in ``failed``)
        good: list[tuple[int, m.SamplingSpec, SamplingParams]] = []
        failed: list[tuple[int, int, str]] = []
        for row, s in zip(rows, specs, strict=True):
            try:
                p = SamplingParams(s.temperature, s.top_p, s.top_k, s.seed, s.logprobs)
            except (ValueError, TypeError) as e:
                failed.append((s.seq_id, BAD_REQUEST, f"bad sampling parameters: {e}"))
                continue
            good.append((row, s, p))
        results = sample_each(
            host[[r for r, _, _ in good]] if good else host[:0],
            [p for _, _, p in good],
            [self._generator(s) for _, s, _ in good],
        )
        seq_ids, tokens, logprobs = [], [], []
        for (_, s, _), res in zip(good, results, strict=True):
            if isinstance(res, Exception):
                failed.append((s.seq_id, INTERNAL, f"sampling failed: {res!r}"))
                continue
            seq_ids.append(s.seq_id)
            tokens.append(res[0])
            logprobs.append(res[1])
        return m.StepReply(
            req.step, seq_ids, tokens, logprobs, seconds=time.perf_counter() - t0, failed=failed
        )

    def _generator(self, spec: m.SamplingSpec) -> np.random.Generator:
        gen = self.generators.get(spec.seq_id)
        if gen is None:
            gen = self.generators[spec.seq_id] = make_generator(spec.seed, spec.salt)
        return gen
