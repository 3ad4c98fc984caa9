"""An idle engine gathers requests arriving together into one first step
(``ROLLBUS_ADMIT_WAIT_MS``, ``ROLLBUS_ADMIT_QUIET_MS``, and the ``more`` a sender says it
still holds); a running batch is never delayed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from services.engine.generation import Generation
from shared import messages as m
from tests.unit.engine.test_step_lock import engine


def gen_with(wait_ms: float, quiet_ms: float | None = None) -> Generation:
    eng = engine()
    eng.settings.admit_wait_ms = wait_ms
    eng.settings.admit_quiet_ms = wait_ms / 2 if quiet_ms is None else quiet_ms
    return eng.scheduler  # type: ignore[no-any-return]


def arrive(gen: Generation, i: int, more: int = 0) -> None:
    """What ``on_gen`` does for a request it queues (``more``: its sender holds that many)."""
    gen.sched.add(m.GenRequest(f"r{i}", [1, 2, 3], 4, temperature=0.0), f"_INBOX.api.{i}")
    gen.last_arrival = time.monotonic()
    gen._coming["_INBOX.api"] = (more, gen.last_arrival)
    gen.arrived.set()


async def test_requests_arriving_together_start_in_one_step() -> None:
    gen = gen_with(4000)  # most 4 s, quiet 2 s: generous, so a slow host cannot flake
    arrive(gen, 0)
    task: asyncio.Task[Any] = asyncio.create_task(gen.gather())
    await asyncio.sleep(0.3)
    assert not task.done()  # still waiting for more: 0.3 s < the quiet gap
    gen.sched.max_batch = 4  # a full batch ends the wait at once
    for i in range(1, 4):
        arrive(gen, i)
    await asyncio.wait_for(task, 1.0)
    plan = gen.sched.schedule()
    assert plan is not None and len(plan.step.rows) == 4


async def test_the_wait_ends_after_a_quiet_gap_and_is_capped_by_the_step_time() -> None:
    gen = gen_with(4000, quiet_ms=50)
    gen.step_avg = 0.2  # a step's round trip: wait at most 0.1 s, quiet 0.05 s
    assert gen.gather_window() == (0.1, 0.05, 4.0)
    arrive(gen, 0)
    t0 = time.monotonic()
    await asyncio.wait_for(gen.gather(), 2.0)
    assert time.monotonic() - t0 >= 0.04  # it did wait (the quiet gap)
    assert gen.gathered > 0


async def test_a_running_batch_or_a_closed_gate_is_never_delayed() -> None:
    gen = gen_with(60_000)  # would wait a minute
    arrive(gen, 0)
    plan = gen.sched.schedule()
    assert plan is not None  # r0 runs now
    arrive(gen, 1)
    await asyncio.wait_for(gen.gather(), 1.0)  # r1 joins the running batch at once
    gen.sched.abort(None)
    gen.sched.schedule()
    arrive(gen, 2)
    gen.admit = False  # paused: nothing to gather for
    await asyncio.wait_for(gen.gather(), 1.0)
    gen.admit = True
    gen0 = gen_with(0)  # ROLLBUS_ADMIT_WAIT_MS=0: start at once
    arrive(gen0, 0)
    await asyncio.wait_for(gen0.gather(), 1.0)


async def test_requests_the_sender_still_holds_are_waited_for() -> None:
    """The API says how many requests it has read and not sent yet: the wait goes on
    past the quiet gap and the step-time cap until they came (bounded by the setting)."""
    gen = gen_with(4000, quiet_ms=1)
    gen.step_avg = 0.02  # alone: at most 10 ms, quiet 1 ms
    arrive(gen, 0, more=2)
    task: asyncio.Task[Any] = asyncio.create_task(gen.gather())
    await asyncio.sleep(0.2)
    arrive(gen, 1, more=1)
    await asyncio.sleep(0.2)
    assert not task.done()  # 0.4 s: 40 times the cap, still waiting for the last one
    arrive(gen, 2, more=0)
    await asyncio.wait_for(task, 1.0)  # the sender holds none more: quiet gap only
    plan = gen.sched.schedule()
    assert plan is not None and len(plan.step.rows) == 3
    assert not gen._coming  # forgotten once the burst started
    # a sender that said more and sent none (a refused request) is waited for at most
    # ROLLBUS_ADMIT_WAIT_MS from the start
    gen = gen_with(300, quiet_ms=1)
    gen.step_avg = 0.02
    arrive(gen, 0, more=5)
    t0 = time.monotonic()
    await asyncio.wait_for(gen.gather(), 2.0)
    assert time.monotonic() - t0 >= 0.29


async def test_the_quiet_gap_grows_with_the_step_time() -> None:
    """A busy host spreads a client's burst (httpx's 16 requests over ≈ 40 ms at load 8,
    ``GenRequest.more`` 0 between its clumps) and slows the steps alike: the quiet gap is
    at least ``QUIET_STEP_SHARE`` of a step, so a burst with gaps of tens of ms between
    arrivals still starts in one step, at 5 % of a step's wait."""
    gen = gen_with(4000, quiet_ms=1)
    assert gen.gather_window() == (4.0, 0.001, 4.0)  # no step yet: the setting alone
    gen.step_avg = 6.0  # a slow step: quiet 0.3 s (5 %), at most 3 s (half)
    assert gen.gather_window() == (3.0, pytest.approx(0.3), 4.0)
    zero = gen_with(4000, quiet_ms=0)
    zero.step_avg = 6.0
    assert zero.gather_window()[1] == 0.0  # 0: no quiet gap, as set
    arrive(gen, 0)
    task: asyncio.Task[Any] = asyncio.create_task(gen.gather())
    for i in range(1, 4):
        await asyncio.sleep(0.05)  # 50 times ADMIT_QUIET_MS, a sixth of the gap
        assert not task.done()
        arrive(gen, i)
    await asyncio.wait_for(task, 2.0)
    plan = gen.sched.schedule()
    assert plan is not None and len(plan.step.rows) == 4
