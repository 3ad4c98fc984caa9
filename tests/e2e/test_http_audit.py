"""Hostile HTTP against a real stack (session 11's black-box audit): refusals that must
name their field and echo the client's id, and calls that must never run with an argument
silently dropped."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import SharedStacks
from tests.e2e.stack import Stack


@pytest.fixture(scope="module")
def stack(shared_stacks: SharedStacks) -> Iterator[Stack]:
    yield from shared_stacks.lend(tp=2, env={"ROLLBUS_KV_CACHE_BLOCKS": "512"})


@pytest.mark.parametrize("query", ["pause_mode=keep", "verify_checksum=true", "version=v0"])
def test_fleet_update_refuses_a_query_parameter_instead_of_dropping_it(
    stack: Stack, query: str
) -> None:
    """The fleet route takes its arguments from the body only: a query parameter
    (`?pause_mode=keep`: running requests must be kept) is 400 naming it, never dropped
    while the transaction runs with the defaults (abort, no checksum)."""
    name = query.split("=")[0]
    with stack.client() as c:
        r = c.post(
            f"/v1/fleet/update_weights?{query}",
            json={"version": "no-such-version"},
            headers={"X-Request-Id": "audit-fleet"},
        )
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["result"] == {"param": name}, body
        assert body["request_id"] == "audit-fleet"
        assert r.headers["x-request-id"] == "audit-fleet"
    st = stack.status()
    assert (st["state"], st["is_paused"]) == ("running", False)


@pytest.mark.parametrize("path", ["/clear_load_weight", "/update_model_weight"])
def test_legacy_route_refusal_names_the_parameter_and_echoes_the_request_id(
    stack: Stack, path: str
) -> None:
    """`GET /clear_load_weight?tags=weight` is 400 naming `tags` in `result.param`, with
    the client's X-Request-Id as `request_id` and in the header, as every control route's
    refusal; nothing slept."""
    with stack.client() as c:
        r = c.get(f"{path}?tags=weight", headers={"X-Request-Id": "audit-legacy"})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error_code"] == 400
    assert body["result"] == {"param": "tags"}, body
    assert body["request_id"] == "audit-legacy"
    assert r.headers.get("x-request-id") == "audit-legacy"
    st = stack.status()
    assert (st["state"], st["is_paused"]) == ("running", False)


@pytest.mark.parametrize(
    "path, body",
    [
        # valid arguments, but more than NATS' max_payload (1 MiB) once they go on the bus
        ("/v1/wakeup", json.dumps({"tags": ["kv_cache"] * 200_000}).encode()),
        ("/v1/update_weights", b'{"version": "v0"' + b" " * 2_000_000 + b"}"),
    ],
    ids=["wakeup-tags", "update-whitespace"],
)
def test_control_arguments_too_large_for_the_bus_are_400_not_500(
    stack: Stack, path: str, body: bytes
) -> None:
    """A body within MAX_BODY_BYTES whose arguments pass every check but do not fit one
    NATS message: 400 naming the body in the control reply shape (it was a plain-text
    500 from nats-py's MaxPayloadError), nothing run, the API still serving."""
    with stack.client() as c:
        r = c.post(path, content=body, headers={"X-Request-Id": "audit-big"})
        assert r.status_code == 400, r.text[:300]
        reply = r.json()
        assert reply["result"] == {"param": "body"}, reply
        assert reply["request_id"] == "audit-big"
        assert c.get("/v1/is_paused").json() == {"is_paused": False}
    st = stack.status()
    assert (st["state"], st["is_paused"]) == ("running", False)


def test_a_generation_body_not_declared_json_is_refused_and_the_connection_serves_on(
    stack: Stack,
) -> None:
    """Session 12's OpenAI audit, over real HTTP: a JSON body sent as `text/plain` (a
    browser form, `curl -d`) is 400 naming the header and generates nothing; the next
    request on the same keep-alive connection is served; `max_completion_tokens` bounds a
    completion (it was ignored there: 16 tokens came back)."""
    body = json.dumps({"prompt": "hi", "max_completion_tokens": 3, "ignore_eos": True})
    with stack.client() as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "text/plain"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "content-type"
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3


def test_a_stop_token_ends_a_choice_outside_its_text_and_is_its_stop_reason(
    stack: Stack,
) -> None:
    """As vLLM V1: the `stop_token_ids` token that ends a choice stays in its token ids,
    is not written in its text (it was), and is the choice's `stop_reason`."""
    body = {
        "prompt": "hi",
        "max_tokens": 64,
        "allowed_token_ids": [65, 66],  # "A", "B": the choice ends at its first B
        "stop_token_ids": [66],
        "seed": 3,
        "return_token_ids": True,
    }
    with stack.client() as c:
        choice = c.post("/v1/completions", json=body).json()["choices"][0]
        events = c.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
    ids = choice["token_ids"]
    assert choice["finish_reason"] == "stop" and ids[-1] == 66 and 66 not in ids[:-1]
    assert choice["text"] == "A" * (len(ids) - 1) and choice["stop_reason"] == 66
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == choice["text"]
    (last,) = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert last["stop_reason"] == 66
