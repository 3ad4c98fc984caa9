"""Hostile generation requests on the session's shared stack: each must fail alone (a
400 naming its field) or be served, while a normal request beside it keeps its greedy
output and ``/health`` stays 200."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import nats

from shared.bus import DEADLINE
from shared.subjects import Subjects
from tests.e2e.stack import Stack

NORMAL: dict[str, Any] = {
    "prompt": "The rollout", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
    "return_token_ids": True,
}  # fmt: skip
# 128 words of 33 two-byte tokens (the byte tokenizer: "é" is two), each tokenized alone
# and after a space: ~17 KB of bad words in every sample spec of the request
WORDS = ["é" * 31 + chr(97 + i % 26) + chr(65 + i // 26) for i in range(128)]


def post(stack: Stack, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with stack.client() as c:
        r = c.post("/v1/completions", json=body)
    return r.status_code, r.json()


def test_sampling_data_past_a_step_message_fails_alone(stack: Stack) -> None:
    """The engine's step message carries each choice's bad_words (and allowed ids, and
    logit_bias): n=64 of these is a 1 MB step, past the server's max_payload. Its publish
    failed, the step loop with it, and every live request ended 503. Now it is a 400
    naming the field; requests that fit alone share steps within the bound; the request
    beside them keeps its output."""
    alone = post(stack, NORMAL)[1]["choices"][0]["token_ids"]
    heavy = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True, "bad_words": WORDS}
    with ThreadPoolExecutor(12) as pool:
        normal = pool.submit(post, stack, NORMAL)
        fits = [pool.submit(post, stack, heavy | {"n": 8}) for _ in range(8)]
        refused = pool.submit(post, stack, heavy | {"n": 64})
        code, body = refused.result()
        assert code == 400 and body["error"]["param"] == "bad_words", body
        assert [f.result()[0] for f in fits] == [200] * 8, [f.result() for f in fits]
        code, body = normal.result()
    assert code == 200 and body["choices"][0]["token_ids"] == alone, body
    with stack.client() as c:
        assert c.get("/health").status_code == 200


async def _json_gen(stack: Stack, data: bytes, headers: dict[str, str]) -> dict[str, Any]:
    """``data`` on ``gen`` as a raw JSON client (no rollbus code): its first reply."""
    nc = await nats.connect(stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(Subjects(stack.instance).gen, data, reply=inbox, headers=headers)
        return dict(json.loads((await sub.next_msg(timeout=30)).data))
    finally:
        await nc.close()


def test_a_gen_refused_for_its_deadline_header_names_its_request_id(stack: Stack) -> None:
    """A raw client reading several requests' chunks from one inbox routes a refusal by
    its ``request_id``: the one for an unreadable ``Rollbus-Deadline`` named none."""
    body = {"request_id": "raw-deadline", "prompt_token_ids": [1, 2], "max_tokens": 2}
    chunk = asyncio.run(_json_gen(stack, json.dumps(body).encode(), {DEADLINE: "soon"}))
    assert (chunk["error_code"], chunk["error_param"]) == (400, DEADLINE), chunk
    assert chunk["request_id"] == "raw-deadline", chunk
