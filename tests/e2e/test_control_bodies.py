"""Control and generation bodies that name a key twice, and control fields given null, over
real HTTP and over a raw nats-py client (plain JSON, no rollbus code in the client), on
the session's shared stack: both transports give the same answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import nats

from tests.e2e.stack import Stack

RID = "Rollbus-Request-Id"
TWICE = b'{"mode": "abort", "mode": "keep"}'  # json / msgspec keep the last: a keeping pause


def post(stack: Stack, path: str, content: bytes) -> httpx.Response:
    with stack.client() as c:
        return c.post(path, content=content, headers={"content-type": "application/json"})


def nats_ctl(stack: Stack, calls: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
    """Each ``(method, body)`` as ``nats req rollbus.<i>.ctl.<method> BODY`` does it."""

    async def go() -> list[dict[str, Any]]:
        nc = await nats.connect(stack.nats_url)
        try:
            out = []
            for method, body in calls:
                msg = await nc.request(f"rollbus.{stack.instance}.ctl.{method}", body, timeout=30)
                out.append(json.loads(msg.data))
            return out
        finally:
            await nc.close()

    return asyncio.run(go())


def is_paused(stack: Stack) -> bool:
    return bool(stack.status()["is_paused"])


DUPLICATES = [  # (route, method, body, the key named twice)
    ("/v1/pause", "pause", TWICE, "mode"),
    ("/v1/sleep", "sleep", b'{"tags": "kv_cache", "tags": "weight"}', "tags"),
    ("/v1/update_weights", "update_weights", b'{"version": "v0", "version": "v1"}', "version"),
    ("/v1/resume", "resume", b'{"x": 1, "x": 2}', "x"),
]


def test_a_control_body_naming_a_key_twice_is_400_over_http_and_nats(stack: Stack) -> None:
    """``{"mode": "abort", "mode": "keep"}`` was a pause that kept (the last wins, silently):
    now a 400 naming the key, and nothing is done, over HTTP and over NATS alike."""
    for route, method, body, key in DUPLICATES:
        r = post(stack, route, body)
        assert r.status_code == 400, (route, r.text)
        assert r.json()["result"]["param"] == key, r.json()
        assert "more than once" in r.json()["error_message"], r.json()
        (rep,) = nats_ctl(stack, [(method, body)])
        assert rep["error_code"] == 400 and rep["result"]["param"] == key, rep
        assert "more than once" in rep["error_message"], rep
        assert stack.status()["state"] == "running"


def test_a_null_control_field_is_its_default_over_http_and_nats(stack: Stack) -> None:
    """``{"mode": null}`` paused with the default mode over HTTP but was a 400 over NATS:
    a known field given null is absent (its default) on both; an unknown one stays a 400
    whatever its value."""
    try:
        for send in ("http", "nats"):
            for body in (b'{"mode": null}', b'{"mode": ""}'):
                if send == "http":
                    r = post(stack, "/v1/pause", body)
                    code, rep = r.status_code, r.json()
                else:
                    (rep,) = nats_ctl(stack, [("pause", body)])
                    code = rep["error_code"]
                assert code == 200, (send, body, rep)
                assert is_paused(stack)
                assert post(stack, "/v1/resume", b"{}").status_code == 200
        (rep,) = nats_ctl(stack, [("status", b'{"fresh": null}')])
        assert rep["error_code"] == 200, rep
        # the others' null was their default already: unchanged
        (rep,) = nats_ctl(
            stack, [("update_weights", b'{"version": null, "verify_checksum": null}')]
        )
        assert rep["error_code"] == 409, rep  # not paused: the arguments were read
        for body in (b'{"mod": null}', b'{"mode": null, "mod": null}'):
            r = post(stack, "/v1/pause", body)
            assert r.status_code == 400 and r.json()["result"]["param"] == "mod", r.text
            (rep,) = nats_ctl(stack, [("pause", body)])
            assert rep["error_code"] == 400 and rep["result"]["param"] == "mod", rep
        assert not is_paused(stack)
    finally:
        post(stack, "/v1/resume", b"")


def test_a_generation_body_naming_a_key_twice_is_400_naming_it(stack: Stack) -> None:
    """Both OpenAI routes read JSON with Python's json: the last of a repeated key won,
    silently (``max_tokens`` 2 then 300: 300 tokens). Now 400 naming it, nested keys by
    their path; a raw NATS client's JSON on ``gen`` gets the same."""
    model = stack.model_dir.name
    cases = [
        ("/v1/completions", b'{"model": "%s", "prompt": "hi", "max_tokens": 2, '
         b'"max_tokens": 300}', "max_tokens"),
        ("/v1/chat/completions", b'{"model": "%s", "max_tokens": 2, "messages": [{"role": '
         b'"user", "content": "hi", "content": "ho"}]}', "messages[0].content"),
        ("/v1/completions", b'{"model": "%s", "prompt": "hi", "max_tokens": 2, '
         b'"logit_bias": {"7": 5, "7": -100}}', "logit_bias.7"),
    ]  # fmt: skip
    for route, body, param in cases:
        r = post(stack, route, body % model.encode())
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "more than once" in err["message"], err
    ok = post(stack, "/v1/completions", b'{"model": "%s", "prompt": "hi", "max_tokens": 2}'
              % model.encode())  # fmt: skip
    assert ok.status_code == 200, ok.text

    async def raw_gen(data: bytes) -> dict[str, Any]:
        nc = await nats.connect(stack.nats_url)
        try:
            msg = await nc.request(f"rollbus.{stack.instance}.gen", data, timeout=30)
            return dict(json.loads(msg.data))
        finally:
            await nc.close()

    chunk = asyncio.run(raw_gen(
        b'{"request_id": "dup-1", "prompt_token_ids": [1, 2], "max_tokens": 2, "max_tokens": 9}'
    ))  # fmt: skip
    assert chunk["error_code"] == 400 and chunk["error_param"] == "max_tokens", chunk
    assert chunk["request_id"] == "dup-1" and "more than once" in chunk["error_message"], chunk
    # the path is the client's: a key of 300k characters is not echoed whole (as over HTTP)
    key = b"k" * 300_000
    chunk = asyncio.run(raw_gen(
        b'{"request_id": "dup-3", "prompt_token_ids": [1, 2], "max_tokens": 2, "%s": 1, '
        b'"%s": 2}' % (key, key)
    ))  # fmt: skip
    assert chunk["error_code"] == 400 and chunk["request_id"] == "dup-3", chunk["error_code"]
    assert len(chunk["error_message"]) < 400 and len(chunk["error_param"]) <= 256, (
        len(chunk["error_message"]), len(chunk["error_param"])
    )  # fmt: skip
    chunk = asyncio.run(raw_gen(  # nor an unknown field's name (as it was before)
        b'{"request_id": "dup-4", "prompt_token_ids": [1, 2], "max_tokens": 2, "%s": 1}' % key
    ))  # fmt: skip
    assert chunk["error_code"] == 400 and chunk["request_id"] == "dup-4", chunk["error_code"]
    assert len(chunk["error_message"]) < 2200 and len(chunk["error_param"]) <= 256, (
        len(chunk["error_message"]), len(chunk["error_param"])
    )  # fmt: skip
    r = post(stack, "/v1/completions", b'{"model": "%s", "prompt": "hi", "%s": 1, "%s": 2}'
             % (model.encode(), key, key))  # fmt: skip
    assert r.status_code == 400 and len(r.text) < 1000, (r.status_code, len(r.text))
    assert stack.status()["requests"] == 0


def test_a_cancel_naming_its_request_twice_cancels_none(stack: Stack) -> None:
    """``gen.cancel`` has no reply: ``{"request_id": "x", "request_id": "dup-2"}`` cancelled
    ``dup-2`` (the last wins); which one was meant is unknown, so none is cancelled (the
    message is dropped as malformed). The same cancel naming it once ends it."""

    async def run(cancel: bytes) -> dict[str, Any]:
        nc = await nats.connect(stack.nats_url)
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            gen = {"request_id": "dup-2", "prompt_token_ids": [1, 2, 3], "max_tokens": 200}
            await nc.publish(f"rollbus.{stack.instance}.gen", json.dumps(gen).encode(), inbox)
            chunks = [json.loads((await sub.next_msg(timeout=30)).data)]
            assert chunks[0].get("heartbeat"), chunks  # queued
            # a notice (no reply) names its request in a header, or it is dropped unread
            await nc.publish(f"rollbus.{stack.instance}.gen.cancel", cancel, headers={RID: "dup-2"})
            while chunks[-1].get("finish_reason") is None:
                chunks.append(json.loads((await sub.next_msg(timeout=30)).data))
            return {"reason": chunks[-1]["finish_reason"],
                    "tokens": sum(len(c.get("token_ids") or ()) for c in chunks)}  # fmt: skip
        finally:
            await nc.close()

    twice = asyncio.run(run(b'{"request_id": "other", "request_id": "dup-2"}'))
    assert twice == {"reason": "length", "tokens": 200}, twice
    once = asyncio.run(run(b'{"request_id": "dup-2"}'))
    assert once["reason"] == "abort" and once["tokens"] < 200, once
