"""Pipelined steps at TP=2, over HTTP: a ``prev`` row ends with the token rank 0 sampled
in the step before, which rank 1 gets only through the all-reduce that shares kept
tokens; were it fed anything else, its half of every layer would differ and so would
the logits. So a batch with staggered arrivals (prefills joining running decodes,
``n`` > 1 forking mid-run, requests ending at different steps) must give, token for
token, what the same batch gives one step at a time (``ROLLBUS_STEP_PIPELINE=false``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import SharedStacks
from tests.e2e.reference import greedy
from tests.e2e.stack import Stack

SERIAL_ENV = {"ROLLBUS_KV_CACHE_BLOCKS": "512", "ROLLBUS_STEP_PIPELINE": "false"}
GAP_S = 0.15  # between two arrivals: each joins a batch already decoding


@pytest.fixture(scope="module")
def serial(shared_stacks: SharedStacks) -> Iterator[Stack]:
    """A tp=2 stack stepping one step at a time (the session's ``stack`` pipelines)."""
    yield from shared_stacks.lend(tp=2, env=SERIAL_ENV)


def bodies() -> list[dict[str, Any]]:
    common = {"model": "tiny", "ignore_eos": True, "return_token_ids": True}
    greedy_ = [
        {"prompt": "rollout 0", "max_tokens": 40},
        {"prompt": "pipeline", "max_tokens": 9},
        {"prompt": "a longer prompt that takes its own prefill step", "max_tokens": 33},
        {"prompt": "one", "max_tokens": 1},
        {"prompt": "three choices", "max_tokens": 21, "n": 3},
        {"prompt": "rank 1", "max_tokens": 27},
    ]
    seeded = [
        {"prompt": "seeded", "max_tokens": 30, "n": 2, "temperature": 0.9, "seed": 7},
        {"prompt": "seeded too", "max_tokens": 12, "temperature": 1.0, "seed": 11},
    ]
    return [{**common, "temperature": 0, **b} for b in greedy_] + [{**common, **b} for b in seeded]


async def _batch(stack: Stack) -> list[list[tuple[list[int], str]]]:
    """Every body, one arriving every GAP_S: each choice's token ids and finish reason."""
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:

        async def one(i: int, body: dict[str, Any]) -> list[tuple[list[int], str]]:
            await asyncio.sleep(i * GAP_S)
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
            return [(ch["token_ids"], ch["finish_reason"]) for ch in choices]

        return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies()))))


def test_pipelined_tp2_gives_token_for_token_what_one_step_at_a_time_gives(
    stack: Stack, serial: Stack
) -> None:
    piped = asyncio.run(_batch(stack))
    steps = stack.status()["steps"]
    one_at_a_time = asyncio.run(_batch(serial))
    for body, p, s in zip(bodies(), piped, one_at_a_time, strict=True):
        assert p == s, (body, p, s)
        assert [len(toks) for toks, _ in p] == [body["max_tokens"]] * body.get("n", 1)
    # the pipelined stack stepped at all (status answers), and both are exact: tp=1 greedy
    assert steps > 0
    first = bodies()[0]
    ids = [256, *str(first["prompt"]).encode()]
    assert piped[0][0][0] == greedy(stack.model_dir, ids, first["max_tokens"])
