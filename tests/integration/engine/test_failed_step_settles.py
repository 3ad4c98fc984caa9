"""After a failed step, the pipelined step sent after it is settled before the engine's
step lock is released: no control call (here ``sleep``, which pauses and then calls the
ranks) and no next step meets it on the ranks — yet every request hears of the failure
at once. Bounded: ``CONTROL_TIMEOUT_S``, or less once a rank it went to is known gone.

The engine's :class:`~services.engine.generation.Generation` runs on a real bus (real
nats-server); the ranks are stood in for by a subscriber that answers steps one at a
time in arrival order (a real rank's one compute thread) and can hold or lose a step:
real ranks serialize a step and a control call on that thread, so they cannot show
whether the engine waited. A rank killed with SIGKILL is a real process.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from nats.aio.msg import Msg

from services.engine import control
from services.engine.generation import GONE_POLL_S
from services.engine.ranks import RankView
from shared import messages as m
from shared import procs
from shared.bus import Bus
from tests.unit.engine.test_step_lock import engine
from tests.unit.engine.test_update_flow import ScriptedRanks

FAIL = 3  # the step that fails: step 4 is in flight behind it (pipelined)


class StandInRanks:
    """Steps answered one at a time, in order. Step FAIL answers once step FAIL+1 has
    arrived (so it surely is in flight); how it fails: ``error`` (a rank's error reply)
    or ``ok`` (the test fails the engine's side). Step FAIL+1 then runs ``hold`` s
    (None: forever, no reply)."""

    def __init__(self, bus: Bus, fail: str, hold: float | None) -> None:
        self.bus, self.fail, self.hold = bus, fail, hold
        self.queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.arrived: dict[int, asyncio.Event] = {}
        self.running = 0  # the step computing now (0: none)
        self.done: dict[int, float] = {}  # step -> when it finished
        self.task = asyncio.ensure_future(self.work())

    async def on_step(self, msg: Msg) -> None:
        step = m.unpack(msg.data, type=m.StepRequest).step
        self.arrived.setdefault(step, asyncio.Event()).set()
        self.queue.put_nowait(msg)

    def busy(self) -> bool:
        return bool(self.running) or not self.queue.empty()

    async def work(self) -> None:
        while True:
            msg = await self.queue.get()
            req = m.unpack(msg.data, type=m.StepRequest)
            self.running = req.step
            ids = [s.seq_id for r in req.rows for s in r.sample]
            reply = m.StepReply(req.step, ids, [5] * len(ids), [-0.1] * len(ids))
            if req.step == FAIL:
                nxt = self.arrived.setdefault(FAIL + 1, asyncio.Event())
                await asyncio.wait_for(nxt.wait(), 10)
                if self.fail == "error":
                    reply = m.StepReply(req.step, [], [], [], error="rank 0: stand-in failure")
            elif req.step == FAIL + 1:
                await asyncio.sleep(self.hold if self.hold is not None else 3600)
            else:
                await asyncio.sleep(0.005)
            await self.bus.publish(msg.reply, m.pack(reply))
            self.running = 0
            self.done[req.step] = time.monotonic()


class Ranks(ScriptedRanks):
    """The control side of the ranks: records whether a step was on the stand-in ranks
    when a control call reached them."""

    def __init__(self, steps: StandInRanks) -> None:
        super().__init__()
        self.steps = steps
        self.view = RankView(2, 0.25)
        self.busy_at_call: list[tuple[str, bool]] = []

    async def call(self, method: str, args: Any = None, **kw: Any) -> dict[int, m.WorkerReply]:
        self.busy_at_call.append((method, self.steps.busy()))
        return await super().call(method, args, **kw)


async def wired(nats_url: str, timeout: float) -> tuple[Any, str, Bus, Bus]:
    """An engine on a real bus with a step subject of its own (``CONTROL_TIMEOUT_S`` =
    ``timeout``), and the buses of the stand-in ranks and of the API."""
    eng = engine()
    eng.settings.control_timeout_s = timeout
    subj = f"t.{uuid.uuid4().hex}.step"
    eng.subjects = SimpleNamespace(worker_step=subj, gen=f"{subj}.gen")
    eng.bus = await Bus.connect(nats_url, "engine")
    return eng, subj, await Bus.connect(nats_url, "ranks"), await Bus.connect(nats_url, "api")


def reported(
    eng: Any, reports: dict[int, dict[str, Any]], pids: dict[int, int] | None = None
) -> None:
    """Each rank's last status report in the engine's view; ``pids``: the ones the engine
    reconciled (default: the reported ones)."""
    eng.rank_pids = pids or {r: rep["pid"] for r, rep in reports.items()}
    for r, rep in reports.items():
        eng.ranks.view.record(eng.ranks.view.begin(), r, rep, time.monotonic())


async def start(
    eng: Any,
    subj: str,
    buses: tuple[Bus, Bus],
    on_step: Any,
    on_chunk: Any,
    rids: dict[str, int] | None = None,
) -> asyncio.Future[Any]:
    """Steps (on the ranks' bus) to ``on_step``, chunks (on the API's) to ``on_chunk``;
    requests ``rids`` (id -> max_tokens; default a and b, 40 each) queued and the
    engine's step loop started (returned)."""
    rank_bus, client = buses
    await rank_bus.subscribe(subj, on_step)
    await client.nc.subscribe(f"{subj}.reply.*", cb=on_chunk)
    await rank_bus.flush()
    await client.flush()
    for rid, n in (rids or {"a": 40, "b": 40}).items():
        eng.scheduler.sched.add(m.GenRequest(rid, [1, 2, 3], n), f"{subj}.reply.{rid}")
    eng.scheduler.work.set()
    return asyncio.ensure_future(eng.scheduler.loop())


async def stop(loop: asyncio.Future[Any] | None, *buses: Bus) -> None:
    if loop is not None:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    for bus in buses:
        await bus.close()


async def run(
    nats_url: str,
    fail: str,
    hold: float | None,
    timeout: float,
    reports: dict[int, dict[str, Any]] | None = None,
    during: Any = None,
    bound: float | None = None,
) -> tuple[Any, StandInRanks, dict[str, float], float]:
    """Two requests through a pipelined run whose step FAIL fails; ``during(eng)`` once
    both have their error; then ``sleep`` (within ``bound``, default timeout + 10 s).
    ``reports``: each rank's last status report (its pid). Returns the engine, the
    stand-in ranks, when each request's error came, and how long the sleep took."""
    eng, subj, rank_bus, client = await wired(nats_url, timeout)
    eng.settings.step_pipeline = True
    steps = StandInRanks(rank_bus, fail, hold)
    eng.ranks = Ranks(steps)
    reported(eng, reports or {0: {"pid": 1}, 1: {"pid": 2}})
    gen = eng.scheduler
    errors: dict[str, float] = {}
    bad: list[m.GenChunk] = []  # a chunk that should not have come
    all_errored = asyncio.Event()

    async def on_chunk(msg: Msg) -> None:
        chunk = m.unpack(msg.data, type=m.GenChunk)
        if chunk.finish_reason == "error":
            errors[chunk.request_id] = time.monotonic()
            if len(errors) == 2:
                all_errored.set()
            why = f"step {FAIL} failed: rank 0" if fail == "error" else "step loop failed"
            if chunk.error_code != 503 or why not in chunk.error_message:
                bad.append(chunk)
        elif chunk.finish_reason:
            bad.append(chunk)

    if fail == "ok":  # the engine's side fails: publishing step FAIL's tokens raises
        real = gen._publish

        async def publish(outputs: list[Any]) -> None:
            if FAIL in steps.done and not raised:
                raised.append(1)
                raise RuntimeError("publish failed")
            await real(outputs)

        raised: list[int] = []

        gen._publish = publish  # type: ignore[method-assign]
    loop = None
    try:
        loop = await start(eng, subj, (rank_bus, client), steps.on_step, on_chunk)
        await asyncio.wait_for(all_errored.wait(), timeout + 10)
        if during is not None:
            during(eng)
        t0 = time.monotonic()
        await asyncio.wait_for(control.sleep(eng, m.TagArgs()), bound or timeout + 10)
        took = time.monotonic() - t0
    finally:
        steps.task.cancel()
        await stop(loop, eng.bus, rank_bus, client)
    assert not bad, bad
    assert not gen.sched.requests and gen.sched.alloc.num_free == eng.settings.kv_cache_blocks
    return eng, steps, errors, took


@pytest.mark.parametrize("fail", ["error", "ok"], ids=["rank-error", "loop-error"])
async def test_the_step_in_flight_after_a_failed_one_is_settled_before_any_control_call(
    nats_url: str, fail: str
) -> None:
    eng, steps, errors, _ = await run(nats_url, fail, hold=1.5, timeout=20.0)
    assert sorted(errors) == ["a", "b"]
    # the requests heard of it at once, not after the step behind it was settled
    assert max(errors.values()) < steps.done[FAIL + 1]
    # the sleep reached the ranks only once that step was done there
    assert eng.ranks.busy_at_call == [("sleep", False)], eng.ranks.busy_at_call
    assert sorted(steps.done) == [1, 2, 3, 4]  # nothing sent after the failure


async def test_a_step_in_flight_that_never_answers_holds_the_lock_for_the_timeout_at_most(
    nats_url: str,
) -> None:
    eng, steps, errors, took = await run(nats_url, "error", hold=None, timeout=1.0)
    assert sorted(errors) == ["a", "b"]
    assert FAIL + 1 not in steps.done and took >= 0.5  # held (for its bound: 1 s from
    # the failure), then released: the sleep did not hang (wait_for's bound)
    assert eng.ranks.busy_at_call == [("sleep", True)]  # past the bound: what it is


async def test_a_killed_rank_ends_the_settle_at_once(nats_url: str) -> None:
    """Rank 1 is a real process, killed with SIGKILL after the failure: the step behind
    the failed one can never be answered, so the lock is released without waiting for
    the (here very long) timeout."""
    proc = subprocess.Popen(["sleep", "600"])  # noqa: S607
    reports = {0: {"pid": 1}, 1: {"pid": proc.pid, "pid_space": procs.pid_space()}}

    def kill(eng: Any) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    try:
        eng, steps, errors, took = await run(
            nats_url, "error", hold=None, timeout=120.0, reports=reports, during=kill, bound=30
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(errors) == ["a", "b"] and FAIL + 1 not in steps.done
    assert eng.ranks.busy_at_call == [("sleep", True)]  # the stand-in holds it forever


async def test_a_step_in_flight_to_a_killed_rank_fails_at_once_naming_it(nats_url: str) -> None:
    """A step that can never be answered (a rank it went to was SIGKILLed while it ran:
    rank 0 would wait in the all-reduce for it) fails as soon as the rank is known gone,
    naming it — not at CONTROL_TIMEOUT_S (here 120 s) — and every request hears it."""
    proc = subprocess.Popen(["sleep", "600"])  # noqa: S607
    eng, subj, rank_bus, client = await wired(nats_url, 120.0)
    eng.settings.step_pipeline = True
    eng.ranks = SimpleNamespace(view=RankView(2, 0.25))
    reported(eng, {0: {"pid": 1}, 1: {"pid": proc.pid, "pid_space": procs.pid_space()}})
    gen = eng.scheduler
    arrived = asyncio.Event()
    errors: dict[str, str] = {}
    both = asyncio.Event()

    async def on_step(msg: Msg) -> None:  # never answered
        arrived.set()

    async def on_chunk(msg: Msg) -> None:
        chunk = m.unpack(msg.data, type=m.GenChunk)
        if chunk.finish_reason == "error":
            errors[chunk.request_id] = chunk.error_message
            if len(errors) == 2:
                both.set()

    loop = None
    try:
        loop = await start(eng, subj, (rank_bus, client), on_step, on_chunk)
        await asyncio.wait_for(arrived.wait(), 10)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        await asyncio.wait_for(both.wait(), 30)  # not the 120 s timeout
    finally:
        await stop(loop, eng.bus, rank_bus, client)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for why in errors.values():
        assert "step 1 failed: ranks [1] gone" in why, why
    assert not gen.sched.requests


async def test_a_slow_step_to_ranks_restarted_before_the_run_is_not_failed(
    nats_url: str,
) -> None:
    """Ranks restarted before a run began (their reports name new pids, the engine has
    not reconciled yet) are the processes its steps go to: a slow step to them is
    answered, not failed as sent to a rank gone."""
    eng, subj, rank_bus, client = await wired(nats_url, 30.0)
    eng.ranks = SimpleNamespace(view=RankView(2, 0.25))
    # rank 1 restarted meanwhile: a new pid; the engine reconciled pid 2 before
    reported(eng, {0: {"pid": 1}, 1: {"pid": 3}}, pids={0: 1, 1: 2})
    chunks: list[m.GenChunk] = []
    ended = asyncio.Event()

    async def on_step(msg: Msg) -> None:  # slow, but answered
        req = m.unpack(msg.data, type=m.StepRequest)
        ids = [s.seq_id for r in req.rows for s in r.sample]
        await asyncio.sleep(2 * GONE_POLL_S + 0.2)
        await rank_bus.publish(msg.reply, m.pack(m.StepReply(req.step, ids, [5] * len(ids),
                                                             [-0.1] * len(ids))))

    async def on_chunk(msg: Msg) -> None:
        chunks.append(m.unpack(msg.data, type=m.GenChunk))
        if chunks[-1].finish_reason:
            ended.set()

    loop = None
    try:
        loop = await start(eng, subj, (rank_bus, client), on_step, on_chunk, {"a": 2})
        await asyncio.wait_for(ended.wait(), 20)
    finally:
        await stop(loop, eng.bus, rank_bus, client)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"], chunks
    assert [t for c in chunks for t in c.token_ids] == [5, 5]
