"""Hostile bus messages as a ``nats`` CLI user sends them (raw nats-py, plain JSON, none
of rollbus's code), against a real stack: each gets a clear answer naming what is wrong,
nothing waits for a timeout, nothing runs that should not."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import nats
import pytest

from shared.subjects import Subjects
from tests.clirun import clean_env, rollbus
from tests.e2e.stack import Stack

DEADLINE = "Rollbus-Deadline"
# not unix epoch milliseconds: a word, empty, a float, a fraction of a millisecond
UNREADABLE = ("soon", "", "1.5e12", "1796147183680.5")


async def _ctl(stack: Stack, method: str, data: bytes, headers: dict[str, str]) -> Any:
    nc = await nats.connect(stack.nats_url)
    try:
        msg = await nc.request(
            Subjects(stack.instance).ctl(method), data, timeout=5, headers=headers
        )
        return json.loads(msg.data)
    finally:
        await nc.close()


async def _gen(stack: Stack, data: bytes, headers: dict[str, str]) -> Any:
    nc = await nats.connect(stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(Subjects(stack.instance).gen, data, reply=inbox, headers=headers)
        return json.loads((await sub.next_msg(timeout=5)).data)
    finally:
        await nc.close()


@pytest.mark.parametrize("bad", UNREADABLE)
def test_an_unreadable_deadline_is_a_400_naming_the_header(stack: Stack, bad: str) -> None:
    """It was dropped without a word: the caller (still waiting: nothing says it gave up)
    sat out its whole timeout with no hint why. The call is not run."""
    hdr = {DEADLINE: bad}
    t0 = time.monotonic()
    for method in ("is_paused", "pause"):
        rep = asyncio.run(_ctl(stack, method, b"{}", hdr))
        assert rep["error_code"] == 400 and rep["result"]["param"] == DEADLINE, rep
        assert DEADLINE in rep["error_message"], rep
    gen = {"request_id": "dl-1", "prompt_token_ids": [1, 2], "max_tokens": 2}
    chunk = asyncio.run(_gen(stack, json.dumps(gen).encode(), hdr))
    assert chunk["error_code"] == 400 and chunk["error_param"] == DEADLINE, chunk
    assert time.monotonic() - t0 < 5  # answered, not timed out
    st = stack.status()
    assert st["state"] == "running" and not st["is_paused"], st  # the pause did not run
    assert st["requests"] == 0, st  # nor was the generation queued


def test_a_readable_deadline_still_works(stack: Stack) -> None:
    """A future deadline is served; a past one is still dropped unanswered (its caller
    was told it failed: README Bus contract)."""
    now = int(time.time() * 1000)
    rep = asyncio.run(_ctl(stack, "is_paused", b"{}", {DEADLINE: str(now + 60_000)}))
    assert rep["error_code"] == 200, rep
    with pytest.raises(nats.errors.TimeoutError):
        asyncio.run(_ctl(stack, "pause", b"{}", {DEADLINE: str(now - 1_000)}))
    assert stack.status()["state"] == "running"


@pytest.mark.parametrize(
    "url", ["nats://api:s3cr3t-pw@[::1", "nats://api:s3cr3t-pw@127.0.0.1:99999,nats://h:1"]
)
def test_an_unparsable_nats_url_is_one_line_without_its_password(tmp_path: Path, url: str) -> None:
    """``ROLLBUS_NATS_URL`` that ``urlsplit`` cannot read (an unclosed IPv6 bracket, a
    port out of range) was a ``ValueError`` traceback from ``rollbus serve``; a bad
    setting is one line naming it, exit 2 — and never echoes the password it carries."""
    env = clean_env(tmp_path / "data", ROLLBUS_NATS_URL=url)
    for args in (["serve"], ["creds", "operator"]):
        r = rollbus(*args, env=env)
        assert r.returncode == 2, (args, r.stderr)
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and "ROLLBUS_NATS_URL" in err, (args, err)
        assert "s3cr3t-pw" not in err + r.stdout, (args, err)


def test_a_gen_request_with_an_unknown_field_is_a_400_naming_it(stack: Stack) -> None:
    """``temprature`` (a typo) was ignored: the request ran, sampled at temperature 1,
    and said nothing. Like every control method, an unknown field is a 400 naming it."""
    gen = {"request_id": "typo-1", "prompt_token_ids": [1, 2], "max_tokens": 2}
    for field in ("temprature", "max_token"):
        chunk = asyncio.run(_gen(stack, json.dumps({**gen, field: 0}).encode(), {}))
        assert chunk["error_code"] == 400 and chunk["error_param"] == field, chunk
    ok = asyncio.run(_gen(stack, json.dumps(gen).encode(), {}))  # the same without it
    assert ok["error_code"] == 0 and ok["heartbeat"], ok


@pytest.mark.parametrize(
    "url", ["nats://trainer:s3cr3t-pw@[::1", "nats://h:1,nats://t:s3cr3t-pw@h:99999"]
)
def test_an_unparsable_nats_url_option_is_a_usage_error_without_its_password(
    tmp_path: Path, url: str
) -> None:
    """``--nats-url`` of ``publish`` / ``versions`` / ``fleet`` was a ``ValueError``
    traceback from the credentials code; it is argparse's usage error naming the option
    (exit 2), and never echoes the password it carries."""
    env = clean_env(tmp_path / "data")
    (tmp_path / "m").mkdir()
    for args in (
        ["publish", str(tmp_path / "m"), "--model", "m", "--version", "v1"],
        ["versions", "--model", "m"],
        ["fleet", "status"],
    ):
        r = rollbus(*args, "--nats-url", url, env=env)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and "--nats-url" in r.stderr.splitlines()[-1], r.stderr
        assert "s3cr3t-pw" not in r.stderr + r.stdout, (args, r.stderr)


@pytest.mark.parametrize("body", [b"[]", b"junk", b'"x"', b"123", b""])
def test_a_raw_gen_body_that_is_no_json_object_gets_a_json_refusal(
    stack: Stack, body: bytes
) -> None:
    """A raw client's ``gen`` body that does not start with ``{`` was read as msgpack and
    refused in msgpack ("Expected object, got int"), unreadable to that client. Only the
    API's msgpack maps are msgpack; anything else is answered in JSON, 400."""
    chunk = asyncio.run(_gen(stack, body, {}))  # json.loads: the answer is JSON
    assert chunk["error_code"] == 400 and chunk["finish_reason"] == "error", chunk
    assert "int" not in chunk["error_message"] or body == b"123", chunk
    assert stack.status()["state"] == "running"


def test_status_counts_dropped_requests_for_the_engine_and_the_api(stack: Stack) -> None:
    """A message on a served subject that is no request (a bare publish: no reply subject,
    no request id) is dropped before any handler runs, and counted: `/v1/status` shows it
    as `bus.dropped_requests` beside the dropped replies (it showed nowhere), for the
    API's bus too; `/metrics` exposes the dropped replies as a counter."""
    before = stack.status()

    async def bare() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            for _ in range(3):
                await nc.publish(Subjects(stack.instance).ctl("pause"), b"{}")
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(bare())
    n = before["bus"]["dropped_requests"]
    deadline = time.monotonic() + 10
    while (after := stack.status())["bus"]["dropped_requests"] < n + 3:
        assert time.monotonic() < deadline, after["bus"]
        time.sleep(0.1)
    assert after["state"] == before["state"]  # the pause never ran
    assert set(after["api"]["bus"]) == {"pending", "dropped", "dropped_requests", "expired"}
    with stack.client() as c:
        text = c.get("/metrics").text
    assert "# TYPE rollbus_bus_dropped_replies_total counter" in text
    assert "\nrollbus_bus_dropped_replies_total " in text
