"""``logit_bias`` through HTTP on the session's shared stack: applied on the rank (a +100
bias makes every greedy and sampled token that id, -100 bans the greedy choice), with
the logprobs of the biased distribution; a malformed one is still a 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.stack import Stack

BODY: dict[str, Any] = {
    "model": "tiny", "prompt": "The rollout", "max_tokens": 6, "ignore_eos": True,
    "return_token_ids": True,
}  # fmt: skip


def complete(stack: Stack, route: str = "/v1/completions", **kw: Any) -> dict[str, Any]:
    body = BODY | kw
    if route.endswith("chat/completions"):
        body = {k: v for k, v in body.items() if k != "prompt"}
        body["messages"] = [{"role": "user", "content": "The rollout"}]
    with stack.client() as c:
        r = c.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_plus_100_makes_every_greedy_and_sampled_token_that_id(stack: Stack) -> None:
    base = complete(stack, temperature=0)["choices"][0]["token_ids"]
    target = next(t for t in (101, 57, 200) if t not in base)
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 2}):
        r = complete(stack, logit_bias={str(target): 100}, logprobs=1, **kw)
        for c in r["choices"]:
            assert c["token_ids"] == [target] * 6, kw
            # the biased distribution's logprobs: the forced token is near-certain
            assert all(lp > -1e-3 for lp in c["logprobs"]["token_logprobs"]), c["logprobs"]
    chat = complete(stack, "/v1/chat/completions", temperature=0, logit_bias={str(target): 100})
    assert chat["choices"][0]["token_ids"] == [target] * 6


def test_minus_100_bans_the_greedy_choice(stack: Stack) -> None:
    base = complete(stack, temperature=0)["choices"][0]["token_ids"]
    r = complete(stack, temperature=0, logit_bias={str(t): -100 for t in set(base)})
    assert not set(r["choices"][0]["token_ids"]) & set(base)


@pytest.mark.parametrize(
    "bias", [{"1": 101}, {"abc": 1}, {"-1": 1}, {"100000": 1}, {"1": "x"}, [1, 2]]
)
def test_a_malformed_logit_bias_is_400_naming_it(stack: Stack, bias: Any) -> None:
    with stack.client() as c:
        r = c.post("/v1/completions", json=BODY | {"logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "logit_bias" in err["message"] and (err.get("param") or "").startswith("logit_bias")


def test_min_tokens_holds_back_stop_ids_until_the_minimum(stack: Stack) -> None:
    base = complete(stack, temperature=0)["choices"][0]["token_ids"]
    stop = {"stop_token_ids": [base[0]], "temperature": 0}
    early = complete(stack, **stop)["choices"][0]
    assert early["finish_reason"] == "stop" and early["token_ids"] == base[:1]
    held = complete(stack, min_tokens=4, **stop)["choices"][0]
    assert len(held["token_ids"]) >= 4 and base[0] not in held["token_ids"][:4]
    with stack.client() as c:
        r = c.post("/v1/completions", json=BODY | {"min_tokens": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
