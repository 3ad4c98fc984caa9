"""vLLM's ``allowed_token_ids`` and ``min_p`` through HTTP on the session's shared stack,
applied on rank 0: allowed ids are the only ones ever sampled (temperature 1, several
choices, completions and chat), ``min_p`` near 1 leaves only the greedy token;
out-of-vocab allowed ids are a 400 naming the field."""

from __future__ import annotations

from typing import Any

from tests.e2e.stack import Stack

BODY: dict[str, Any] = {
    "model": "tiny", "prompt": "The rollout", "max_tokens": 8, "ignore_eos": True,
    "return_token_ids": True,
}  # fmt: skip


def complete(stack: Stack, **kw: Any) -> dict[str, Any]:
    with stack.client() as c:
        r = c.post("/v1/completions", json=BODY | kw)
    assert r.status_code == 200, r.text
    return r.json()


def test_allowed_token_ids_are_the_only_ones_sampled(stack: Stack) -> None:
    greedy = complete(stack, temperature=0)["choices"][0]["token_ids"]
    a, b = [t for t in (101, 57, 200) if t not in greedy[:1]][:2]  # not the model's pick
    r = complete(stack, temperature=1.0, seed=5, n=4, allowed_token_ids=[a, b], logprobs=1)
    got = [t for c in r["choices"] for t in c["token_ids"]]
    assert len(got) == 32 and set(got) <= {a, b} and len(set(got)) == 2, got
    for c in r["choices"]:  # the masked distribution's logprobs: two tokens share it all
        lps, tops = c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]
        for lp, top in zip(lps, tops, strict=True):
            assert lp <= 0 and all(v > -1e9 for v in top.values())
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "max_tokens": 8}
    with stack.client() as c:
        r2 = c.post("/v1/chat/completions", json=chat | {"allowed_token_ids": [a],
                                                         "return_token_ids": True})  # fmt: skip
    assert r2.status_code == 200, r2.text
    assert r2.json()["choices"][0]["token_ids"] == [a] * 8  # ignore_eos unset: a is no eos


def test_min_p_near_one_is_the_greedy_token(stack: Stack) -> None:
    greedy = complete(stack, temperature=0)["choices"][0]["token_ids"]
    r = complete(stack, temperature=1.0, seed=1, n=3, min_p=0.9999)
    assert all(c["token_ids"] == greedy for c in r["choices"]), (greedy, r["choices"])


def test_out_of_vocab_allowed_ids_are_400_naming_the_field(stack: Stack) -> None:
    with stack.client() as c:
        r = c.post("/v1/completions", json=BODY | {"allowed_token_ids": [1, 10**6]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_single_and_multi_token(stack: Stack) -> None:
    """With "a" forced (+100) and "b" next (+50): bad_words ["a"] never writes "a";
    ["aa"] bans the second "a" of a pair, also on pipelined decode steps (the engine
    does not yet have the token a step in flight sampled; rank 0 adds it)."""
    bias = {"97": 100, "98": 50}  # the byte tokenizer: "a", "b"
    kw: dict[str, Any] = {"logit_bias": bias, "max_tokens": 10}
    assert complete(stack, temperature=0, **kw)["choices"][0]["token_ids"] == [97] * 10
    for temp in (0, 1.0):
        one = complete(stack, temperature=temp, seed=2, bad_words=["a"], **kw)
        assert one["choices"][0]["token_ids"] == [98] * 10
        two = complete(stack, temperature=temp, seed=2, bad_words=["aa"], **kw)
        assert two["choices"][0]["token_ids"] == [97, 98] * 5, two["choices"][0]
