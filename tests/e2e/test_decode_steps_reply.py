"""A step of several decode iterations (``ROLLBUS_DECODE_STEPS``) is answered by one reply
from rank 0 holding every iteration's samples, with their top alternatives: K times the
bytes of a one-token step's. Past the NATS server's ``max_payload`` that reply cannot be
published and the whole step fails (every request in it, 503) where one-token steps serve
the same requests. Checked on a server whose max_payload is 32 KiB: 64 choices asking
20 alternatives each are ~9 KB of reply per iteration, ~70 KB for 8."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.stack import Stack, small_payload_stack

MAX_PAYLOAD = 32 * 1024
ENV = {"ROLLBUS_KV_CACHE_BLOCKS": "1024", "ROLLBUS_DECODE_STEPS": "32"}


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with small_payload_stack(tmp_path_factory, "replies", MAX_PAYLOAD, tp=1, env=ENV) as s:
        yield s


def test_a_multi_step_reply_with_top_alternatives_fits_max_payload(small_stack: Stack) -> None:
    """n=64 choices with 20 top alternatives: the steps run fewer iterations (the reply's
    room), every choice completes with its 17 tokens and their alternatives."""
    body = {"model": small_stack.model_dir.name, "prompt": [5, 6, 7], "max_tokens": 17,
            "n": 64, "temperature": 1.0, "seed": 1, "logprobs": 20, "ignore_eos": True}  # fmt: skip
    with small_stack.client(timeout=180) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 64
        for ch in choices:
            assert ch["finish_reason"] == "length", ch
            top = ch["logprobs"]["top_logprobs"]
            # keyed by text: tokens of one text (bytes of one character) share a key
            assert len(top) == 17 and all(0 < len(t) <= 21 for t in top), ch
        st = small_stack.status()
        assert st["step_time"]["iterations"] > st["steps"]  # still several per step
        assert c.get("/health").status_code == 200


def test_a_coalesced_choice_of_many_tokens_per_step_fits_max_payload(small_stack: Stack) -> None:
    """A non-streamed request without stop strings has its tokens held and sent every few
    steps in one chunk: with 32 tokens per step and 20 alternatives each, 16 steps of them
    are ~75 KB, past the server's max_payload: the chunk goes out before that."""
    body = {"model": small_stack.model_dir.name, "prompt": [5, 6, 7], "max_tokens": 700,
            "temperature": 1.0, "seed": 2, "logprobs": 20, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    with small_stack.client(timeout=180) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        (ch,) = r.json()["choices"]
        assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 700
        assert len(ch["logprobs"]["top_logprobs"]) == 700
        assert c.get("/health").status_code == 200
