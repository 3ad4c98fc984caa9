"""``repetition_penalty`` / ``presence_penalty`` / ``frequency_penalty`` through HTTP on
the session's shared TP=2 stack: the greedy tokens and logprobs are those of the
in-process TP=1 reference whose logits go through the documented formulas (repetition
over the prompt and the output, presence / frequency over the output) — completions and
chat, streamed and not, ``n`` = 2 (a choice forked from the prompt) — and a large
``repetition_penalty`` makes a model that repeats itself stop."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.e2e.reference import greedy
from tests.e2e.stack import Stack

PROMPT = [5, 17, 200, 3, 99, 42, 7, 11]
NEW = 16


def penalise(
    prompt: list[int], rep: float = 1.0, presence: float = 0.0, frequency: float = 0.0,
    seen: list[np.ndarray] | None = None,
) -> Any:  # fmt: skip
    """``process`` for :func:`greedy`: the formulas, dense over the vocabulary; the
    processed logits of each step appended to ``seen``."""

    def process(logits: np.ndarray, out: list[int]) -> np.ndarray:
        y = logits.astype(np.float64)
        hit = np.zeros(len(y), bool)
        hit[prompt + out] = True
        y = np.where(hit, np.where(y > 0, y / rep, y * rep), y)
        counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=len(y))
        y = y - (counts * frequency + (counts > 0) * presence)
        if seen is not None:
            seen.append(y)
        return y

    return process


def log_softmax(y: np.ndarray) -> np.ndarray:
    s = y - y.max()
    return np.asarray(s - np.log(np.exp(s).sum()))


def ask(stack: Stack, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The choices of one request, by index: token_ids, logprobs (streamed: joined)."""
    with stack.client() as c:
        if not body.get("stream"):
            r = c.post(route, json=body)
            assert r.status_code == 200, r.text
            out = []
            for ch in r.json()["choices"]:
                lp = ch["logprobs"]
                lps = lp["token_logprobs"] if "token_logprobs" in lp else [
                    e["logprob"] for e in lp["content"]
                ]  # fmt: skip
                out.append({"tokens": ch["token_ids"], "logprobs": lps})
            return out
        got: dict[int, dict[str, list[Any]]] = {}
        with c.stream("POST", route, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for ch in json.loads(line[6:])["choices"]:
                    g = got.setdefault(ch["index"], {"tokens": [], "logprobs": []})
                    g["tokens"] += ch.get("token_ids") or []
                    lp = ch.get("logprobs") or {}
                    g["logprobs"] += lp.get("token_logprobs") or [
                        e["logprob"] for e in lp.get("content") or []
                    ]
        return [got[i] for i in sorted(got)]


PENALTIES = [
    {"repetition_penalty": 1.8},
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5},
]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_the_penalised_reference(stack: Stack, stream: bool) -> None:
    plain = greedy(stack.model_dir, PROMPT, NEW)
    for pen in PENALTIES:
        steps: list[np.ndarray] = []
        rep = pen.get("repetition_penalty", 1.0)
        process = penalise(PROMPT, rep, pen.get("presence_penalty", 0.0),
                           pen.get("frequency_penalty", 0.0), steps)  # fmt: skip
        want = greedy(stack.model_dir, PROMPT, NEW, process=process)
        body = {
            "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1, "n": 2, "stream": stream, **pen,
        }  # fmt: skip
        choices = ask(stack, "/v1/completions", body)
        assert len(choices) == 2
        for c in choices:  # choice 1 forks from choice 0's prompt: the same greedy walk
            assert c["tokens"] == want, pen
            # the logprobs of the penalised distribution (the one sampled from)
            ref = [log_softmax(y)[t] for y, t in zip(steps, want, strict=True)]
            np.testing.assert_allclose(c["logprobs"], ref, atol=2e-3)
        if pen.get("repetition_penalty", 1.0) > 1 or pen.get("presence_penalty", 0.0) > 0:
            assert want != plain, pen  # the penalty did change the greedy walk


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_the_penalised_reference(stack: Stack, stream: bool) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "The rollout"}], "max_tokens": NEW,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": True,
        "presence_penalty": 2.0, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
    }  # fmt: skip
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=body | {"max_tokens": 1})
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt_token_ids"]
    want = greedy(stack.model_dir, prompt, NEW, process=penalise(prompt, 1.3, 2.0, 1.0))
    assert want != greedy(stack.model_dir, prompt, NEW)
    (choice,) = ask(stack, "/v1/chat/completions", body | {"stream": stream})
    assert choice["tokens"] == want


def test_a_large_repetition_penalty_stops_the_repeats(stack: Stack) -> None:
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1}  # fmt: skip
    (plain,) = ask(stack, "/v1/completions", body)
    toks = plain["tokens"]
    assert len(set(toks)) < len(toks)  # this random model repeats itself
    (held,) = ask(stack, "/v1/completions", body | {"repetition_penalty": 1e6})
    # every id already in the prompt or the output is pushed to ~0 or far below: none
    # comes again while an unseen id has a positive logit
    assert len(set(held["tokens"])) == NEW and not set(held["tokens"]) & set(PROMPT)


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)],
)
def test_out_of_range_is_400_naming_it(stack: Stack, field: str, value: float) -> None:
    with stack.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
