"""Rank 0's reply to a one-token step holds a sample per choice in it, each with its top
alternatives: many choices asking ``top_logprobs`` in one step passed the NATS server's
``max_payload``, the reply was not published and every request in the step failed (503).
Checked on a 32 KiB server with a 4096-token vocabulary (alternatives' ids of 3 msgpack
bytes): the planner keeps each step's reply within it, and a request whose choices alone
could never fit one is refused (400)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from services.tiny_model import TINY_CONFIG
from tests.e2e.stack import Stack, small_payload_stack

MAX_PAYLOAD = 32 * 1024
ENV = {
    "ROLLBUS_KV_CACHE_BLOCKS": "2048",
    "ROLLBUS_MAX_N": "128",
    "ROLLBUS_MAX_BATCH_SIZE": "256",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {**TINY_CONFIG, "vocab_size": 4096}
    with small_payload_stack(
        tmp_path_factory, "replybud", MAX_PAYLOAD, tp=1, env=ENV, model_config=config
    ) as s:
        yield s


def complete(stack: Stack, body: dict[str, Any]) -> Any:
    with stack.client(timeout=300) as c:
        return c.post("/v1/completions", json=body)


def test_concurrent_requests_of_many_choices_with_top_alternatives_all_complete(
    stack: Stack,
) -> None:
    """Four requests of n=100 choices asking 20 alternatives: ~30 KB of reply per 200
    samples, more than a 32 KiB message once two prefill rows (or 200+ decode rows) share
    a step. All complete; the one of n=128 (up to 26 KB of reply alone) is refused."""
    body = {"model": stack.model_dir.name, "prompt": [5, 6, 7], "max_tokens": 6, "n": 100,
            "temperature": 1.0, "logprobs": 20, "ignore_eos": True}  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda i: complete(stack, {**body, "seed": i}), range(4)))
    for r in rs:
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 100
        for ch in choices:
            assert ch["finish_reason"] == "length", ch
            assert len(ch["logprobs"]["top_logprobs"]) == 6, ch
    r = complete(stack, {**body, "n": 128})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_logprobs", r.text
    with stack.client() as c:
        assert c.get("/health").status_code == 200
