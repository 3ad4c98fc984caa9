"""Bad input, backpressure and correlation ids against a real stack (issue 7, items 1,
4, 5): over HTTP and over raw NATS, with other requests running beside them."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest

from shared import messages as m
from shared.subjects import Subjects
from tests.e2e.stack import Stack, start_stack

MAX_WAITING = 3
STREAM_BUFFER = 128  # small enough for the slow-reader test, big enough that a CPU-starved API
# process (2 loaded cores) does not drop a stream that is being read
BODY_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        Path(tmp_path_factory.mktemp("edge")),
        nats_url,
        tp=2,
        env={
            "ROLLBUS_KV_CACHE_BLOCKS": "4096",
            "ROLLBUS_MAX_WAITING": str(MAX_WAITING),
            "ROLLBUS_STREAM_BUFFER": str(STREAM_BUFFER),
            "ROLLBUS_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        },
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def running(stack: Stack) -> Iterator[None]:
    yield
    with stack.client() as c:
        c.post("/v1/resume")
    wait_for(lambda: stack.status()["requests"] == 0, "requests left running")


def wait_for(cond: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out: {what}")


def post(stack: Stack, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    with stack.client() as c:
        if isinstance(body, bytes):
            kw.setdefault("headers", {})["content-type"] = "application/json"
            return c.post(path, content=body, **kw)
        return c.post(path, json=body, **kw)


class LongStream(threading.Thread):
    """A streamed completion of ``tokens`` tokens, read in the background."""

    def __init__(self, stack: Stack, tokens: int = 400) -> None:
        super().__init__(daemon=True)
        self.stack, self.tokens = stack, tokens
        self.token_ids: list[int] = []
        self.finish: str | None = None
        self.errors: list[Any] = []
        self.started = threading.Event()

    def run(self) -> None:
        body = {
            "prompt": "a long one",
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        with self.stack.client(timeout=300) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.errors.append(chunk["error"])
                        continue
                    for ch in chunk["choices"]:
                        self.token_ids += ch.get("token_ids") or []
                        self.finish = ch["finish_reason"] or self.finish
                    self.started.set()

    def assert_complete(self) -> None:
        self.join(300)
        assert not self.errors, self.errors
        assert len(self.token_ids) == self.tokens and self.finish == "length"


def greedy(stack: Stack, prompt: str = "check", tokens: int = 12) -> list[int]:
    r = post(
        stack,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


# --------------------------------------------------------------------------- item 1


def test_nan_temperature_is_400_while_a_long_stream_completes(stack: Stack) -> None:
    long = LongStream(stack, tokens=400)
    long.start()
    assert long.started.wait(60)
    for bad in ("NaN", "Infinity", "-Infinity"):  # what Python's json writes
        raw = f'{{"prompt": "x", "max_tokens": 4, "temperature": {bad}}}'.encode()
        r = post(stack, "/v1/completions", raw)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
        assert err["code"] == 400 and "finite" in err["message"]
    r = post(stack, "/v1/chat/completions", {"messages": [{"role": "user"}], "top_p": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    long.assert_complete()


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "x", "n": 65}', "n"),  # ROLLBUS_MAX_N=64
        (b'{"prompt": "x", "stop": ' + json.dumps(["s"] * 65).encode() + b"}", "stop"),
        (b'{"prompt": "x", "max_tokens": 99999}', "max_tokens"),
        (b'{"prompt": "\xc3\x28"}', "body"),  # invalid UTF-8
        (b"[" * 200 + b"]" * 200, "body"),
        (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    ],
)
def test_bad_generation_bodies_name_the_field(stack: Stack, raw: bytes, param: str) -> None:
    r = post(stack, "/v1/completions", raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_body_over_the_limit_is_400(stack: Stack) -> None:
    big = b'{"prompt": "' + b"x" * (4 * 1024 * 1024 + 1) + b'"}'
    r = post(stack, "/v1/completions", big)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = post(stack, "/v1/update_weights", big)
    assert r.status_code == 400 and r.json()["result"]["param"] == "body"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/pause"])
def test_a_body_shorter_than_its_content_length_is_400_not_held_forever(
    stack: Stack, path: str
) -> None:
    port = int(stack.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=BODY_TIMEOUT_S + 30) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            'Content-Length: 100\r\n\r\n{"prompt": "hi"'.encode()
        )  # 15 of the 100 bytes announced; the connection stays open
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply
    doc = json.loads(body)
    param = doc["error"]["param"] if path == "/v1/completions" else doc["result"]["param"]
    assert param == "body" and "incomplete" in str(doc)


def test_bad_control_arguments_name_the_field(stack: Stack) -> None:
    with stack.client() as c:
        r = c.post("/v1/pause", params={"mode": "sideways"})
        assert r.status_code == 400 and r.json()["result"]["param"] == "mode"
        r = c.post("/v1/sleep", params={"tags": "weights"})
        assert r.status_code == 400 and r.json()["result"]["param"] == "tags"
        r = c.post("/v1/update_weights", json={"version": 3})
        assert r.status_code == 400 and r.json()["result"]["param"] == "version"
        r = c.post("/v1/update_weights", content=b'{"version": NaN}')
        assert r.status_code == 400 and r.json()["result"]["param"] == "version"
        r = c.post("/v1/resume", json={"mode": "keep"})  # resume takes no argument
        assert r.status_code == 400 and r.json()["result"]["param"] == "mode"
        assert not c.get("/v1/is_paused").json()["is_paused"]  # none reached the engine
        # over raw NATS the engine checks the same (a version is a path component)
        assert c.post("/v1/pause").status_code == 200
        for data in (b'{"version": "../x"}', b'{"version": "a\\u0000b"}'):
            rep = json.loads(
                asyncio.run(_raw(stack, Subjects(stack.instance).ctl("update_weights"), data))
            )
            assert rep["error_code"] == 400 and rep["result"]["param"] == "version", rep


def test_hostile_control_requests_over_raw_nats_get_a_small_400_and_the_engine_lives(
    stack: Stack,
) -> None:
    """A reply echoing what a client sent must fit the server's max_payload: one that did
    not (a 600 KB request id echoed in the reply's header) made the server close the
    engine's connection, and nats-py never reconnects after that — the engine was gone
    from the bus for good (every later call: no responders)."""
    ctl = Subjects(stack.instance).ctl

    async def go() -> list[tuple[dict[str, Any], int]]:
        nc = await nats.connect(stack.nats_url)
        try:
            out = []
            for subj, data, headers in (
                (ctl("is_paused"), b"{}", {"Rollbus-Request-Id": "r" * 600_000}),
                (ctl("pause"), json.dumps({"k" * 600_000: 1}).encode(), None),
                (ctl("sleep"), json.dumps({"tags": "x" * 900_000}).encode(), None),
                (ctl("sleep"), b'{"tags": "weights"}', None),
                (ctl("is_paused"), b"{}", None),
            ):
                msg = await nc.request(subj, data, timeout=20, headers=headers)
                out.append((json.loads(msg.data), len(msg.data)))
            return out
        finally:
            await nc.close()

    (rid, _), (field, n1), (tags, n2), (tag, _), (alive, _) = asyncio.run(go())
    assert rid["error_code"] == 400 and rid["result"]["param"] == "Rollbus-Request-Id", rid
    assert field["error_code"] == 400 and field["result"]["param"].startswith("kkk"), field
    assert n1 < 8192 and n2 < 8192  # the 600 / 900 KB the client sent are not echoed back
    assert tags["error_code"] == 400 and tags["result"]["param"] == "tags"
    assert tag["error_code"] == 400 and tag["result"]["param"] == "tags", tag  # as over HTTP
    assert alive["error_code"] == 200 and alive["result"]["is_paused"] is False


def test_fleet_stage_over_raw_nats_checks_the_version_before_touching_the_engine(
    stack: Stack,
) -> None:
    """``fleet_stage`` with a version that cannot be a path component: 400 naming
    ``version`` at once, as ``update_weights`` — it used to pause the running engine, turn
    it ``updating`` and send the name to every rank (whose 400 named no field)."""
    subj = Subjects(stack.instance)

    async def go() -> tuple[list[dict[str, Any]], list[str]]:
        nc = await nats.connect(stack.nats_url)
        seen: list[str] = []

        async def on_event(msg: Any) -> None:
            seen.append(msg.subject)

        await nc.subscribe(subj.event(">"), cb=on_event)
        await nc.flush()
        try:
            out = []
            for version in ("..", "a/b", "a\nb"):
                data = json.dumps({"txn": "t1", "version": version}).encode()
                msg = await nc.request(subj.ctl("fleet_stage"), data, timeout=20)
                out.append(json.loads(msg.data))
            await nc.flush()
            await asyncio.sleep(0.5)
            return out, seen
        finally:
            await nc.close()

    replies, events = asyncio.run(go())
    for rep in replies:
        assert rep["error_code"] == 400 and rep["result"]["param"] == "version", rep
    assert not any(e.endswith(".state") for e in events), events  # never paused / updating
    assert stack.status()["state"] == "running"


async def _raw(stack: Stack, subject: str, data: bytes) -> bytes:
    nc = await nats.connect(stack.nats_url)
    try:
        return bytes((await nc.request(subject, data, timeout=20)).data)
    finally:
        await nc.close()


def raw_gen(stack: Stack, data: bytes) -> m.GenChunk:
    reply = asyncio.run(_raw(stack, Subjects(stack.instance).gen, data))
    return m.unpack(reply, type=m.GenChunk)


def raw_step(stack: Stack, data: bytes) -> m.StepReply:
    reply = asyncio.run(_raw(stack, Subjects(stack.instance).worker_step, data))
    return m.unpack(reply, type=m.StepReply)


def test_hostile_gen_messages_over_raw_nats_fail_alone(stack: Stack) -> None:
    before = greedy(stack)
    long = LongStream(stack, tokens=300)
    long.start()
    assert long.started.wait(60)
    gen = {"request_id": "raw-1", "prompt_token_ids": [1, 2, 3], "max_tokens": 4}
    cases = [
        (dict(gen, temperature=math.nan), "temperature"),
        (dict(gen, prompt_token_ids=[1, 10**6]), "prompt_token_ids"),
        (dict(gen, n=10**6), "n"),
        (dict(gen, max_tokens=-1), "max_tokens"),
        (dict(gen, top_p=math.inf), "top_p"),
        ({}, "request_id"),
        ({"no": "request"}, "no"),  # an unknown field is named, as for control methods
    ]
    for body, param in cases:
        chunk = raw_gen(stack, msgspec.msgpack.encode(body))
        assert chunk.error_code == 400 and chunk.finish_reason == "error", (body, chunk)
        assert chunk.error_param == param
    # not a msgpack map: a raw client's text, refused in JSON
    junk = json.loads(asyncio.run(_raw(stack, Subjects(stack.instance).gen, b"\x00\xff garbage")))
    assert junk["error_code"] == 400, junk
    asyncio.run(_publish(stack, Subjects(stack.instance).gen + ".cancel", b"not json"))
    long.assert_complete()
    assert greedy(stack) == before
    assert stack.status()["requests"] == 0


async def _json_gen(stack: Stack, data: bytes) -> list[dict[str, Any]]:
    """``data`` on ``gen`` as a raw JSON client: every reply chunk (JSON) to the last."""
    nc = await nats.connect(stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(Subjects(stack.instance).gen, data, reply=inbox)
        chunks: list[dict[str, Any]] = []
        while not chunks or chunks[-1].get("finish_reason") is None:
            chunks.append(json.loads((await sub.next_msg(timeout=30)).data))
        return chunks
    finally:
        await nc.close()


def test_gen_over_raw_nats_takes_json_and_answers_json(stack: Stack) -> None:
    """`nats req rollbus.<i>.gen '{...}'` works: checked like msgpack, answered in JSON."""
    long = LongStream(stack, tokens=300)
    long.start()
    assert long.started.wait(60)
    gen = {"request_id": "json-1", "prompt_token_ids": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    chunks = asyncio.run(_json_gen(stack, json.dumps(gen).encode()))
    assert chunks[0]["heartbeat"] and chunks[-1]["finish_reason"] == "length"
    assert sum(len(c["token_ids"]) for c in chunks) == 4
    assert {c["request_id"] for c in chunks} == {"json-1"}
    cases = [
        (json.dumps(dict(gen, temperature=math.nan)).encode(), "temperature", "json-1"),
        (json.dumps(dict(gen, n=10**6)).encode(), "n", "json-1"),
        (b'{"request_id": "\\ud800", "prompt_token_ids": [1], "max_tokens": 1}', "request_id", ""),
    ]
    for data, param, rid in cases:
        (chunk,) = asyncio.run(_json_gen(stack, data))
        assert chunk["error_code"] == 400 and chunk["error_param"] == param, chunk
        assert chunk["request_id"] == rid
    long.assert_complete()


async def _publish(stack: Stack, subject: str, data: bytes) -> None:
    nc = await nats.connect(stack.nats_url)
    try:
        await nc.publish(subject, data)
        await nc.flush()
    finally:
        await nc.close()


def metric(stack: Stack, prefix: str) -> float:
    return stack.metric(prefix)


def bad_chunk(rid: str) -> bytes:
    """A chunk that decodes but is malformed: one top id, no bytes of its logprob."""
    return m.pack(m.GenChunk(rid, 0, [5], [-0.1], "v0", top=[m.TopLogprobs([1], b"")]))


async def _hostile_batches(stack: Stack) -> tuple[list[dict[str, Any]], httpx.Response]:
    """Forged messages on the API's batch inbox (``<inbox prefix>.batch``, sniffed on the
    unauthenticated test server) while a stream and a non-streamed request run: garbage,
    ~700 KB of unknown tokens, a victim's token with another id, then a malformed chunk
    for each victim (the stream, then the non-streamed one), then one for the ended
    stream. Returns the stream's events and the non-streamed answer."""
    # no_echo: the sniffer sees only what the engine sends, never the forgeries published
    # on this connection (one names a request "not-its-id": on a CPU-starved runner it was
    # sniffed only after the stream ended and taken for the non-streamed victim, which ran
    # on unharmed: a 200, or a client timeout, instead of the 503)
    nc = await nats.connect(stack.nats_url, no_echo=True)
    seen: dict[str, tuple[str, str]] = {}  # request id -> (batch subject, its token)
    news = asyncio.Event()

    async def sniff(msg: Any) -> None:
        for token, rid, _ in msgspec.msgpack.decode(msg.data):
            if rid not in seen:
                seen[rid] = (msg.subject, token)
                news.set()

    async def sniffed(rid: str | None = None, skip: frozenset[str] = frozenset()) -> str:
        while not (rid in seen if rid else set(seen) - skip):
            news.clear()
            await asyncio.wait_for(news.wait(), 60)
        return rid or sorted(set(seen) - skip)[0]

    await nc.subscribe("_INBOX.*.batch", cb=sniff)
    await nc.flush()
    events: list[dict[str, Any]] = []
    body = {"prompt": "victim", "max_tokens": 2000, "ignore_eos": True, "logprobs": 2}
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        break
                rid = events[0]["id"].removeprefix("cmpl-")
                subject, token = seen[await sniffed(rid)]
                bad_top = bad_chunk(rid)
                for data in [
                    b"\xc1 not msgpack",
                    msgspec.msgpack.encode([["f" * 32, rid, b"x" * 64]] * 5000),
                    msgspec.msgpack.encode([[token, "not-its-id", bad_top]]),
                    msgspec.msgpack.encode([[token, rid, b"\xc1"]]),  # the victim's own
                ]:
                    await nc.publish(subject, data)
                async for line in lines:
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
            await nc.publish(subject, msgspec.msgpack.encode([[token, rid, bad_top]]))  # ended
            known = set(seen)
            pending = asyncio.ensure_future(c.post("/v1/completions", json=body))
            other = await sniffed(skip=frozenset(known))
            subject, token = seen[other]
            await nc.publish(subject, msgspec.msgpack.encode([[token, other, bad_chunk(other)]]))
            return events, await pending
    finally:
        await nc.close()


def test_hostile_batches_on_the_api_inbox_fail_only_their_targets(stack: Stack) -> None:
    """Nothing sent to the API's batch inbox stops its subscription or reaches another
    request: garbage and unknown tokens are dropped and counted; a malformed chunk under
    a request's own token and id fails that request alone with a clear 503 (an error
    event in its stream, a JSON 503 when not streamed; its engine request cancelled);
    a stream running beside them completes exactly, the API keeps serving."""
    before = greedy(stack)
    # the counter's sample alone: its bare name also prefixes `…_created` (a timestamp)
    dropped = metric(stack, "rollbus_bus_dropped_replies_total ")
    long = LongStream(stack, tokens=300)
    long.start()
    assert long.started.wait(60)
    events, answer = asyncio.run(_hostile_batches(stack))
    assert answer.status_code == 503, answer.text[:300]
    assert "malformed token chunk" in answer.json()["error"]["message"]
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 503, events[-3:]
    assert "malformed token chunk" in errors[0]["message"]
    assert not any(ch["finish_reason"] for e in events for ch in e.get("choices", []))
    long.assert_complete()
    wait_for(lambda: stack.status()["requests"] == 0, "the victims cancelled in the engine")
    assert greedy(stack) == before
    # garbage, 5000 unknown, another's id, the two malformed, the ended one's
    assert metric(stack, "rollbus_bus_dropped_replies_total ") >= dropped + 5005
    assert metric(stack, 'rollbus_task_failures_total{process="api"') == 0


def test_hostile_step_messages_get_an_error_reply_and_ranks_keep_serving(stack: Stack) -> None:
    before = greedy(stack)
    assert "not a step" in raw_step(stack, b"\x93garbage").error
    bad_rows = [
        m.StepRow(1 << 40, [1, 10**6], 0, [0], []),  # token id outside the vocabulary
        m.StepRow(1 << 40, [1, 2], 0, [10**6], []),  # block outside the cache
        m.StepRow(1 << 40, [1, 2], -5, [0], []),
        m.StepRow(1 << 40, [], 0, [0], []),
    ]
    for row in bad_rows:
        reply = raw_step(stack, m.pack(m.StepRequest(1 << 40, [row])))
        assert "bad step" in reply.error, row
    # a well-formed step whose sampling parameters are bad: only that sequence fails
    # (a step number out of sequence is refused by every rank before any collective, so
    # the ranks are first brought to a known number by an empty step)
    assert "missed steps" in raw_step(stack, m.pack(m.StepRequest(1 << 40, []))).error
    spec = m.SamplingSpec(1 << 40, temperature=math.nan)
    step = m.StepRequest((1 << 40) + 1, [m.StepRow(1 << 40, [1, 2], 0, [1023], [spec])])
    reply = raw_step(stack, m.pack(step))
    assert not reply.error and [f[:2] for f in reply.failed] == [(1 << 40, 400)]
    with stack.client() as c:
        assert c.get("/health").status_code == 200
    assert greedy(stack) == before


# --------------------------------------------------------------------------- item 4


class Pending(threading.Thread):
    def __init__(self, stack: Stack, body: dict[str, Any], timeout: float = 120) -> None:
        super().__init__(daemon=True)
        self.stack, self.body, self.timeout = stack, body, timeout
        self.response: httpx.Response | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with self.stack.client(timeout=self.timeout) as c:
                self.response = c.post("/v1/completions", json=self.body)
        except httpx.HTTPError as e:
            self.error = e


def test_full_queue_answers_429_with_retry_after(stack: Stack) -> None:
    assert post(stack, "/v1/pause", params={"mode": "keep"}).status_code == 200
    queued = [Pending(stack, {"prompt": f"q{i}", "max_tokens": 3}) for i in range(MAX_WAITING)]
    for p in queued:
        p.start()
    wait_for(lambda: stack.status()["queued"] == MAX_WAITING, "requests queued")
    for stream in (False, True):
        r = post(stack, "/v1/completions", {"prompt": "late", "max_tokens": 3, "stream": stream})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"].isdigit()
        err = r.json()["error"]
        assert err["code"] == 429 and err["type"] == "rate_limit_error"
        assert "ROLLBUS_MAX_WAITING" in err["message"]
    assert post(stack, "/v1/resume").status_code == 200
    for p in queued:
        p.join(120)
        assert p.response is not None and p.response.status_code == 200, p.error
    assert post(stack, "/v1/completions", {"prompt": "now", "max_tokens": 3}).status_code == 200


def test_a_list_of_prompts_fails_whole_when_one_is_refused(stack: Stack) -> None:
    """Each prompt is its own engine request: past MAX_WAITING one is refused (429), the
    call answers 429 and the prompts already queued are cancelled, not left waiting."""
    assert post(stack, "/v1/pause", params={"mode": "keep"}).status_code == 200
    prompts = [f"p{i}" for i in range(MAX_WAITING + 2)]
    for stream in (False, True):
        body = {"prompt": prompts, "max_tokens": 3, "stream": stream}
        r = post(stack, "/v1/completions", body)
        assert r.status_code == 429, r.text
        assert "ROLLBUS_MAX_WAITING" in r.json()["error"]["message"]
        # still paused: only a cancellation can empty the queue
        wait_for(lambda: stack.status()["requests"] == 0, "the other prompts cancelled", 20)
    # a client leaving a call of several prompts cancels every one of them
    leaver = Pending(stack, {"prompt": prompts[:MAX_WAITING], "max_tokens": 5}, timeout=3)
    leaver.start()
    wait_for(lambda: stack.status()["requests"] == MAX_WAITING, "prompts queued")
    leaver.join(30)
    assert isinstance(leaver.error, httpx.TimeoutException)
    wait_for(lambda: stack.status()["requests"] == 0, "the engine cancelled them", timeout=20)
    assert post(stack, "/v1/resume").status_code == 200
    r = post(stack, "/v1/completions", {"prompt": prompts[:2], "max_tokens": 3, "n": 2})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]


def test_a_non_streaming_client_that_leaves_frees_its_request(stack: Stack) -> None:
    assert post(stack, "/v1/pause", params={"mode": "keep"}).status_code == 200
    leaver = Pending(stack, {"prompt": "bye", "max_tokens": 5}, timeout=3)
    leaver.start()
    wait_for(lambda: stack.status()["requests"] == 1, "request queued")
    leaver.join(30)
    assert isinstance(leaver.error, httpx.TimeoutException)  # the client gave up, went away
    wait_for(lambda: stack.status()["requests"] == 0, "the engine cancelled it", timeout=20)
    st = stack.status()
    assert st["queued"] == st["waiting"] == st["running"] == 0


def test_a_slow_stream_reader_loses_only_its_own_stream(stack: Stack) -> None:
    """64 choices x 800 tokens of SSE (~20 MB) to a reader that never reads: past the
    kernel's socket buffers (a few MB on loopback) and ``STREAM_BUFFER`` chunks per choice
    (of up to ``ROLLBUS_DECODE_STEPS`` = 4 tokens each), the API gives up on it; a stream
    running beside it (fair rows) completes."""
    other = LongStream(stack, tokens=100)
    body = json.dumps(
        {
            "prompt": "slow reader",
            "n": 64,
            "max_tokens": 800,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 1,
            "return_token_ids": True,
        }
    ).encode()
    host, port = stack.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        wait_for(lambda: stack.status()["running"] >= 64, "the slow request runs")
        other.start()
        other.assert_complete()
        # the reader never reads: the API drops its stream and the engine its request
        wait_for(lambda: stack.status()["requests"] == 0, "slow request cancelled", 240)
        received = b""
        sock.settimeout(30)
        while chunk := sock.recv(1 << 16):  # the server closed the connection
            received += chunk
        assert b"data: [DONE]" not in received
        assert received.count(b'"finish_reason": "length"') < 64
    finally:
        sock.close()


# --------------------------------------------------------------------------- item 5

ODD_IDS = ["a.b", "*", ">", "a b", "x.*.>", "in  side\tspaces", "y" * 10240, "dup", "dup", "dup"]


def test_any_x_request_id_is_echoed_and_replies_never_cross(stack: Stack) -> None:
    unicode_id = "ünïcødé ✓".encode()

    async def run() -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as c:

            async def completion(rid: bytes, prompt: str) -> None:
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
                while True:  # ROLLBUS_MAX_WAITING is 3 here: a polite client retries
                    r = await c.post(
                        "/v1/completions",
                        json={**body, "return_token_ids": True},
                        headers={"X-Request-Id": rid},
                    )
                    assert dict(r.headers.raw)[b"x-request-id"] == rid
                    if r.status_code != 429:
                        break
                    await asyncio.sleep(float(r.headers["retry-after"]))
                assert r.status_code == 200, r.text
                assert r.headers.raw and dict(r.headers.raw)[b"x-request-id"] == rid
                assert r.json()["choices"][0]["token_ids"] == expected[prompt]

            async def control(rid: bytes, path: str) -> None:
                r = await c.get(path, headers={"X-Request-Id": rid})
                assert r.status_code == 200, r.text
                assert dict(r.headers.raw)[b"x-request-id"] == rid

            ids = [i.encode() for i in ODD_IDS] + [unicode_id]
            calls = []
            for i, rid in enumerate(ids):
                calls.append(completion(rid, f"p{i % 4}"))
                calls.append(control(rid, "/v1/status" if i % 2 else "/v1/is_paused"))
            await asyncio.gather(*calls)

    expected = {f"p{i}": greedy(stack, f"p{i}", 8) for i in range(4)}
    asyncio.run(run())
    for rid in ("a.b", "*", ">"):  # the reproduced hang: a control call answered at once
        with stack.client(timeout=10) as c:
            r = c.post("/v1/resume", headers={"X-Request-Id": rid})
            assert r.status_code == 200 and r.json()["request_id"] == rid
            assert r.headers["x-request-id"] == rid
