"""Control calls against pipelined steps (stand-in ranks of ``test_pipeline``, which
answer in order and count the steps in flight): a ``pause(wait)`` that comes when the
last sequence has ended but the step sent behind it is still out returns only once it
is answered; a pause / update / resume / pause / update / resume in quick succession
meets no step in flight and labels every token with the weights that computed it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from services.engine import control
from shared import messages as m
from tests.unit.engine.test_pipeline import VERSIONS, Ranks
from tests.unit.engine.test_step_lock import engine


async def _serve(eng: Any, gens: list[m.GenRequest], until: Any) -> None:
    gen = eng.scheduler
    for g in gens:
        gen.sched.add(g, f"inbox.{g.request_id}")
    gen.work.set()
    loop = asyncio.create_task(gen.loop())
    try:
        for _ in range(3000):
            if until():
                break
            await asyncio.sleep(0.002)
        assert until(), "never done"
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


def _engine() -> tuple[Any, Ranks]:
    eng = engine()
    eng.settings.step_pipeline = True
    eng.subjects = SimpleNamespace(worker_step="step", gen="gen")
    eng.bus = ranks = Ranks()
    return eng, ranks


async def test_pause_wait_when_the_last_sequence_ended_waits_for_the_step_behind_it() -> None:
    eng, ranks = _engine()
    gen = eng.scheduler
    at_return: list[int] = []
    tasks: list[asyncio.Task[None]] = []

    async def pause() -> None:
        await gen.pause("wait")
        at_return.append(ranks.in_flight)

    def on_chunk(rid: str, c: m.GenChunk) -> None:
        if c.finish_reason == "stop":  # nothing runs any more; its extra row is in flight
            assert not gen.sched.running and ranks.in_flight == 1
            tasks.append(asyncio.get_running_loop().create_task(pause()))

    ranks.on_chunk = on_chunk
    await _serve(eng, [m.GenRequest("c", [9], 30, stop_token_ids=[40])], lambda: at_return)
    await asyncio.gather(*tasks)
    assert at_return == [0] and not gen.run  # paused, with no step out
    assert ranks.chunks["c"][-1].finish_reason == "stop"


async def test_updates_right_after_resumes_meet_no_step_in_flight() -> None:
    """pause(keep) mid-run, update to v1, resume, and at once pause(keep), update back to
    v0, resume: the control calls meet no step in flight, each token carries the version
    that computed it, and the requests finish whole."""
    eng, ranks = _engine()
    gen = eng.scheduler
    eng.state.weight_version = "v0"
    in_flight_at_update: list[int] = []
    done: list[bool] = []

    async def update(version: str) -> None:
        await control.pause(eng, m.PauseArgs("keep"))
        async with gen.quiet():
            in_flight_at_update.append(ranks.in_flight)
            eng.state.weight_version = version
            gen.weights_changed(version)
        await control.resume(eng, m.NoArgs())

    async def flip() -> None:
        await update("v1")
        await update("v0")  # right after the resume: the loop just sent a step again
        done.append(True)

    def on_chunk(rid: str, c: m.GenChunk) -> None:
        if rid == "a" and len(ranks.chunks["a"]) == 3:
            asyncio.get_running_loop().create_task(flip())

    ranks.on_chunk = on_chunk
    gens = [m.GenRequest("a", [5, 6, 7], 20), m.GenRequest("b", [1, 2], 25, n=2, seed=3)]
    await _serve(eng, gens, lambda: done and not gen.sched.requests and not gen.active)
    assert in_flight_at_update == [0, 0] and ranks.in_flight == 0
    for rid, chunks in ranks.chunks.items():
        by_index: dict[int, list[int]] = {}
        for c in chunks:
            assert c.finish_reason in (None, "length"), c
            for tok in c.token_ids:
                assert c.version == ("v1" if tok > VERSIONS["v1"] else "v0"), (rid, c, tok)
            by_index.setdefault(c.index, []).extend(c.token_ids)
        want = {"a": 20, "b": 25}[rid]
        assert all(len(toks) == want for toks in by_index.values()), (rid, by_index)
    assert gen.sched.preemptions >= 3  # kept sequences recomputed after the updates
