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

One step at a time holds ``step_lock``; control methods take it to act between steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from nats.micro.service import Service

from services.engine.scheduler import Output, Scheduler, Seq
from shared import messages as m
from shared.bus import REQUEST_ID
from shared.errors import BAD_REQUEST, UNAVAILABLE, ControlError
from shared.model_config import context_length

if TYPE_CHECKING:
    from services.engine.main import Engine

log = logging.getLogger("rollbus.engine.gen")

HEARTBEAT_S = 5.0


def max_model_len(model_dir: Path, setting: int) -> int:
    if setting:
        return setting
    return context_length(json.loads((model_dir / "config.json").read_text()))


class Generation:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        s = engine.settings
        self.max_model_len = max_model_len(s.model_dir, s.max_model_len)
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
        self.step_seconds = 0.0
        self.steps = 0

    # ------------------------------------------------------------------ bus side

    async def start(self, svc: Service) -> None:
        subj = self.engine.subjects.gen
        await self.engine.bus.subscribe(subj, self.on_gen, queue="engine")
        await self.engine.bus.subscribe(subj + ".cancel", self.on_cancel)

    def background(self) -> list[asyncio.Task[Any]]:
        return [asyncio.create_task(self.loop()), asyncio.create_task(self.heartbeats())]

    async def on_gen(self, msg: Msg) -> None:
        try:
            gen = m.unpack(msg.data, type=m.GenRequest)
        except Exception as e:  # noqa: BLE001 - a bad message must still get an answer
            if msg.reply:
                await self._send(
                    msg.reply,
                    m.GenChunk(
                        "",
                        finish_reason="error",
                        error_code=BAD_REQUEST,
                        error_message=f"bad request: {e}",
                    ),
                )
            return
        if not msg.reply:
            return
        why = self.sched.check(gen)
        if why:
            await self._send(
                msg.reply,
                m.GenChunk(
                    gen.request_id, finish_reason="error", error_code=BAD_REQUEST, error_message=why
                ),
            )
            return
        self.sched.add(gen, msg.reply)
        self.work.set()

    async def on_cancel(self, msg: Msg) -> None:
        self._cancels.append(m.json_decode(msg.data, type=m.GenCancel).request_id)
        self.work.set()

    async def _send(self, reply: str, chunk: m.GenChunk) -> None:
        await self.engine.bus.publish(reply, m.pack(chunk), headers={REQUEST_ID: chunk.request_id})

    def _chunk(self, out: Output) -> m.GenChunk:
        seq = out.seq
        return m.GenChunk(
            seq.req.request_id,
            seq.index,
            [] if out.token is None else [out.token],
            None if out.logprob is None or not seq.req.gen.logprobs else [out.logprob],
            seq.spans[-1].version if seq.spans else self.engine.state.weight_version,
            out.finish_reason,
            list(seq.spans) if out.finish_reason else None,
        )

    async def _publish(self, outputs: list[Output]) -> None:
        for out in outputs:
            await self._send(out.seq.req.reply, self._chunk(out))

    async def _end(self, seqs: list[Seq]) -> None:
        await self._publish([Output(s, None, None, s.finish_reason) for s in seqs])

    # ------------------------------------------------------------------ loop

    async def loop(self) -> None:
        while True:
            await self.work.wait()
            async with self.step_lock:
                for rid in self._cancels:
                    await self._end(self.sched.abort(rid, "abort"))
                self._cancels.clear()
                plan = self.sched.schedule(admit=self.admit, run=self.run)
                if plan is None:
                    self.work.clear()
                    if not self.sched.running:
                        self.drained.set()
                    continue
                self.drained.clear()
                try:
                    outputs = await self._step(plan)
                except ControlError as e:
                    await self._fail_all(e)
                    continue
                await self._publish(outputs)
            await asyncio.sleep(0)  # let control handlers take the lock between steps

    async def _step(self, plan: Any) -> list[Output]:
        eng = self.engine
        t0 = time.perf_counter()
        rep = await eng.bus.request(
            eng.subjects.worker_step, m.pack(plan.step), timeout=eng.settings.control_timeout_s
        )
        reply = m.unpack(rep.data, type=m.StepReply)
        if reply.error:
            raise ControlError(UNAVAILABLE, f"step failed: {reply.error}")
        self.step_seconds += time.perf_counter() - t0
        self.steps += 1
        return self.sched.apply(plan, reply, eng.state.weight_version)

    async def _fail_all(self, err: ControlError) -> None:
        log.error("failing all requests: %s", err.message)
        ended = self.sched.abort(None, "error")
        self.sched.reset_blocks()
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
        """Tell the API every waiting request is still alive (it may wait for a resume)."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            for req in list(self.sched.requests.values()):
                await self._send(req.reply, m.GenChunk(req.request_id, heartbeat=True))

    # ------------------------------------------------------------------ control hooks

    async def pause(self, mode: str) -> int:
        """Close the gates; returns how many requests were aborted."""
        if mode == "wait":
            self.admit = False
            self.work.set()
            timeout = self.engine.settings.control_timeout_s
            try:
                await asyncio.wait_for(self._drain(), timeout)
            except TimeoutError:
                # admission stays closed; the running requests go on finishing
                raise ControlError(
                    UNAVAILABLE,
                    f"pause(wait): {len(self.sched.running)} requests still running after "
                    f"{timeout:g}s; the engine stays paused and admits nothing",
                ) from None
            self.run = False
            return 0
        self.admit = self.run = False
        async with self.step_lock:  # the in-flight step completes first
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

    def resume(self) -> None:
        if self.recompute:
            self.sched.recompute_all()
            self.recompute = False
        self.admit = self.run = True
        self.work.set()

    def drop_kv(self) -> None:
        self.sched.reset_blocks()
        self.recompute = True

    def weights_changed(self, version: str) -> None:
        if self.sched.running:
            self.recompute = True

    def counts(self) -> dict[str, Any]:
        return {**self.sched.counts(), "steps": self.steps}
