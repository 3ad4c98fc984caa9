"""An idle engine starts a burst of requests in one step (``ROLLBUS_ADMIT_WAIT_MS``,
``ROLLBUS_ADMIT_QUIET_MS``, ``GenRequest.more``), through a real stack over HTTP.

Counted in engine steps, not seconds (robust on a busy host): ``BATCH`` requests of
``MAX_TOKENS`` tokens that share their first step take exactly ``MAX_TOKENS`` decode
iterations (``step_time.iterations``: a step message may carry several)
(the prefill samples the first token; the end of the batch sends no step of its own).
Each group that joins later costs the batch its own steps: sent ``GAP_S`` apart to a
tiny model (a step of a few ms), the requests would run one after the other without
the gather (≈ ``BATCH`` × ``MAX_TOKENS`` steps)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from nats.aio.msg import Msg

from shared import messages as m
from shared.bus import Bus
from shared.subjects import Subjects
from tests.e2e.conftest import SharedStacks
from tests.e2e.stack import Stack

BATCH = 8
MAX_TOKENS = 6
GAP_S = 0.03  # between two sends; the quiet gap below is 40x that (a busy host's client)
ENV = {
    "ROLLBUS_ADMIT_WAIT_MS": "10000",  # the gather's bound: far above the burst's length
    "ROLLBUS_ADMIT_QUIET_MS": "1200",  # no arrival for this long: the burst is over
    "ROLLBUS_KV_CACHE_BLOCKS": "128",
}


@pytest.fixture(scope="module")
def fresh(shared_stacks: SharedStacks) -> Iterator[Stack]:
    """Its own tp=1 stack: no step has run on it yet, so no step time caps the wait."""
    yield from shared_stacks.lend(tp=1, env=ENV)


async def _burst(stack: Stack, gap: float) -> list[int]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
        await asyncio.gather(*(c.get("/v1/models") for _ in range(BATCH)))  # connections up

        async def one(i: int) -> int:
            await asyncio.sleep(i * gap)
            body = {"model": "tiny", "prompt": f"burst {i}", "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["completion_tokens"])

        return list(await asyncio.gather(*(one(i) for i in range(BATCH))))


def test_a_burst_of_requests_starts_in_one_step(fresh: Stack) -> None:
    before = fresh.status()
    assert before["steps"] == 0, "the gather's bound must not be capped by a step time yet"
    tokens = asyncio.run(_burst(fresh, GAP_S))
    after = fresh.status()
    assert tokens == [MAX_TOKENS] * BATCH
    steps = after["steps"] - before["steps"]
    assert after["step_time"]["rows"] - before["step_time"]["rows"] == BATCH * steps
    # one prefill step for all, then MAX_TOKENS - 1 decode iterations: nothing else
    # (ROLLBUS_DECODE_STEPS: a step message may carry several of them)
    iters = after["step_time"]["iterations"] - before["step_time"]["iterations"]
    assert iters == MAX_TOKENS, after
    assert after["step_time"]["admit_wait_s"] > (BATCH - 1) * GAP_S * 0.5


async def _seen_more(stack: Stack, body: dict[str, object]) -> list[int]:
    """``more`` of every gen message the API sends for one request (a plain subscriber
    sees a copy of each: the engine's is a queue subscription)."""
    bus = await Bus.connect(stack.nats_url, "test-admission")
    seen: list[int] = []

    async def on(msg: Msg) -> None:
        seen.append(m.unpack(msg.data, type=m.GenRequest).more)

    try:
        await bus.subscribe(Subjects(stack.instance).gen, on)
        await bus.flush()
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        await bus.flush()
    finally:
        await bus.close()
    return seen


def test_the_api_tells_the_engine_how_many_more_it_holds(fresh: Stack) -> None:
    """A list of prompts is sent as one engine request each: each says how many of the
    others are still to come, so the engine waits for them and not for a quiet gap."""
    body = {"model": "tiny", "prompt": ["a", "b", "c", "d"], "max_tokens": 2,
            "temperature": 0}
    before = fresh.status()["steps"]
    assert asyncio.run(_seen_more(fresh, body)) == [3, 2, 1, 0]
    assert fresh.status()["steps"] - before == 2
