"""Steps of several decode iterations (``ROLLBUS_DECODE_STEPS``) over HTTP, at TP=1 and
TP=2: a stack stepping 4 iterations per step message gives, response for response, what
a stack stepping one token per message gives — greedy and seeded sampling, ``n`` > 1,
penalties, ``logit_bias``, logprobs and top alternatives, a stop token, eos, a stop
string and ``min_tokens`` ending choices mid-window, ``max_tokens`` not a multiple of 4,
and streams (one event per token, as before). At TP=2 rank 1 gets each iteration's
tokens only through the share of rank 0's samples: fed anything else, its half of every
layer, and so the logits, would differ."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import SharedStacks
from tests.e2e.stack import Stack

KV = {"ROLLBUS_KV_CACHE_BLOCKS": "512"}
EOS = 257  # the tiny model's


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def pair(
    request: pytest.FixtureRequest, shared_stacks: SharedStacks
) -> Iterator[tuple[Stack, Stack]]:
    """(one token per step, 4 iterations per step) stacks of one TP."""
    tp = request.param
    one = shared_stacks.lend(tp=tp, env={**KV, "ROLLBUS_DECODE_STEPS": "1"})
    four = shared_stacks.lend(tp=tp, env={**KV, "ROLLBUS_DECODE_STEPS": "4"})
    yield next(one), next(four)
    for gen in (one, four):
        with pytest.raises(StopIteration):
            next(gen)


def bodies(stop_at: int, stop_text: str) -> list[dict[str, Any]]:
    common = {"model": "tiny", "return_token_ids": True, "logprobs": 2}
    pen = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    out = [
        {"prompt": "greedy", "max_tokens": 13, "temperature": 0, "ignore_eos": True},
        {"prompt": "seeded", "max_tokens": 10, "n": 3, "temperature": 0.9, "seed": 7,
         "ignore_eos": True},
        {"prompt": "penalised", "max_tokens": 11, "temperature": 0.8, "seed": 3, "n": 2,
         "ignore_eos": True, **pen},
        {"prompt": "biased", "max_tokens": 9, "temperature": 0, "ignore_eos": True,
         "logit_bias": {"101": 3.0, "50": -100}},
        # eos made likely: choices end on it at seeded positions, mid-window
        {"prompt": "eos", "max_tokens": 30, "n": 4, "temperature": 1.0, "seed": 5,
         "logit_bias": {str(EOS): 4.0}},
        {"prompt": "greedy", "max_tokens": 13, "temperature": 0, "ignore_eos": True,
         "stop_token_ids": [stop_at]},
        {"prompt": "greedy", "max_tokens": 13, "temperature": 0, "ignore_eos": True,
         "stop": [stop_text]},
        {"prompt": "min", "max_tokens": 12, "min_tokens": 6, "temperature": 1.0, "seed": 2,
         "logit_bias": {str(EOS): 5.0}},
    ]  # fmt: skip
    return [{**common, **b} for b in out]


def _same(a: Any, b: Any) -> bool:
    """``a`` is ``b``: tokens, texts, reasons exactly; logprobs to float32's noise (a row's
    logits move in their last bits with the batch it shares a step with, and two stacks
    batch concurrent requests a little differently, one token per step or not)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _choices(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def _events(r: httpx.Response) -> dict[int, list[Any]]:
    """A stream's events by choice, in order, without their id / created (the choices
    of ``n`` > 1 interleave as their chunks come: 4 tokens of one, then of the next)."""
    assert r.status_code == 200, r.text
    out: dict[int, list[Any]] = {}
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or [{"index": -1, "usage": ev.get("usage")}]:
                out.setdefault(ch["index"], []).append(ch)
    return out


async def _all(stack: Stack, bodies: list[dict[str, Any]]) -> list[Any]:
    """Every body at once (one batch), non-streamed and streamed."""
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:

        async def one(body: dict[str, Any], stream: bool) -> Any:
            r = await c.post("/v1/completions", json={**body, "stream": stream})
            return _events(r) if stream else _choices(r)

        runs = [one(b, s) for s in (False, True) for b in bodies]
        return list(await asyncio.gather(*runs))


def test_four_iterations_per_step_give_what_one_gives(pair: tuple[Stack, Stack]) -> None:
    one, four = pair
    with one.client() as c:
        base = _choices(c.post("/v1/completions", json=bodies(0, "x")[0]))[0]
    at = 6  # a mid-window token (windows of 4 after the prefill's: 1-4, 5-8, ...)
    stop_at = base["token_ids"][at]
    stop_text = base["text"][-4:-2]
    bs = bodies(stop_at, stop_text)
    before = four.status()
    got_one = asyncio.run(_all(one, bs))
    got_four = asyncio.run(_all(four, bs))
    after = four.status()
    for body, a, b in zip(bs * 2, got_one, got_four, strict=True):
        assert _same(a, b), (body, a, b)
    # the stacks did what they say: 4 iterations in some steps, 1 in every step of the other
    steps = after["steps"] - before["steps"]
    iters = after["step_time"]["iterations"] - before["step_time"]["iterations"]
    assert iters > steps
    st1 = one.status()
    assert st1["step_time"]["iterations"] == st1["steps"]
    # the cases hit what they are about
    by = dict(zip(range(len(bs)), got_one[: len(bs)], strict=True))
    assert by[5][0]["finish_reason"] == "stop" and by[5][0]["token_ids"][-1] == stop_at
    assert len(by[5][0]["token_ids"]) <= at + 1
    assert by[6][0]["finish_reason"] == "stop" and len(by[6][0]["token_ids"]) < 13
    eos = [ch for ch in by[4] if ch["finish_reason"] == "stop"]
    assert eos and any(len(ch["token_ids"]) % 4 != 1 for ch in eos)
    assert all(len(ch["token_ids"]) >= 6 for ch in by[7])
    # a stream: one event per token, as before
    assert len(got_four[len(bs)][0]) >= 13
