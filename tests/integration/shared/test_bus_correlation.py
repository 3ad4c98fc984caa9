"""Correlation against a real nats-server: a caller's request id is never a subject
token (any string works, duplicates never cross), and a streamed request keeps at most
``max_unread`` replies for a slow reader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from shared.bus import (
    REQUEST_ID,
    Bus,
    StreamOverflow,
    batch_subject,
    pack_batch,
    pack_batches,
)
from tests.integration.shared.test_bus import connect, settle, subject

ODD_IDS = ["a.b", "*", ">", "a b", "a.*.>", "ünïcødé ✓", "x" * 1024, "", "~2E"]


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, "test-bus-corr")
    yield b
    await b.close()


async def recorder(
    bus: Bus, nats_url: str, n: int
) -> tuple[str, Any, dict[str, str], asyncio.Event]:
    """A responder on a new subject (its own connection) that only records each
    request's reply subject by its request id; the event is set once ``n`` requests were
    seen. Returns the subject, the connection, the record and the event."""
    subj = subject()
    nc = await connect(nats_url)
    seen: dict[str, str] = {}  # request id -> its reply subject
    ready = asyncio.Event()

    async def record(msg):  # noqa: ANN001
        seen[(msg.headers or {})[REQUEST_ID]] = msg.reply
        if len(seen) == n:
            ready.set()

    await nc.subscribe(subj, cb=record)
    await settle(bus, nc)
    return subj, nc, seen, ready


def read_all(
    streams: dict[str, Any], counts: dict[str, int]
) -> tuple[dict[str, list[bytes]], list[asyncio.Task[None]]]:
    """A reader task per stream, reading ``counts[rid]`` replies (each carrying its
    request id) into the lists returned."""
    got: dict[str, list[bytes]] = {rid: [] for rid in streams}

    async def read(rid: str) -> None:
        async for rep in streams[rid]:
            got[rid].append(rep.data)
            assert rep.headers[REQUEST_ID] == rid
            if len(got[rid]) == counts[rid]:
                return

    return got, [asyncio.create_task(read(rid)) for rid in streams]


async def close_all(tasks: Iterable[asyncio.Future[Any]], streams: Iterable[Any], nc: Any) -> None:
    """Cancel the readers, close the streams, then the responder's connection."""
    for t in tasks:
        t.cancel()
    for s in streams:
        await s.aclose()
    await nc.close()


async def test_any_request_id_gets_its_own_reply(bus: Bus, nats_url: str) -> None:
    subj = subject()
    nc = await connect(nats_url)

    async def echo(msg):  # noqa: ANN001 - answer with the request id it carried, a bit later
        await asyncio.sleep(0.01 * (len(msg.data) % 5))
        rid = (msg.headers or {}).get(REQUEST_ID, "")
        await nc.publish(msg.reply, msg.data, headers={REQUEST_ID: rid})

    await nc.subscribe(subj, cb=echo)
    await settle(bus, nc)
    try:
        # every odd id, each sent by several concurrent requests with distinct bodies
        calls = [(rid, f"{rid}#{i}".encode()) for rid in ODD_IDS for i in range(3)]
        replies = await asyncio.gather(
            *(bus.request(subj, body, timeout=5, request_id=rid) for rid, body in calls)
        )
        for (rid, body), rep in zip(calls, replies, strict=True):
            assert rep.data == body  # never another request's reply
            if rid:
                assert rep.headers[REQUEST_ID] == rid
        assert not bus._pending
    finally:
        await nc.close()


async def test_a_slow_stream_reader_loses_only_its_own_stream(bus: Bus, nats_url: str) -> None:
    subj = subject()
    nc = await connect(nats_url)

    async def flood(msg):  # noqa: ANN001
        for i in range(50):
            await nc.publish(msg.reply, str(i).encode())

    await nc.subscribe(subj, cb=flood)
    await settle(bus, nc)
    overflowed = asyncio.Event()
    try:
        slow = bus.stream(
            subj, b"", idle_timeout=5, max_unread=10, on_overflow=overflowed.set
        )
        fast = bus.stream(subj, b"", idle_timeout=5, max_unread=100)
        reading = asyncio.ensure_future(slow.__anext__())  # sent; nobody reads after that
        got = [(await fast.__anext__()).data for _ in range(50)]
        assert got == [str(i).encode() for i in range(50)]  # the other stream is whole
        await asyncio.wait_for(overflowed.wait(), 5)
        with pytest.raises(StreamOverflow):  # at most the first reply, then the error
            await reading
            await slow.__anext__()
        await slow.aclose()
        await fast.aclose()
        assert not bus._pending
    finally:
        await nc.close()


async def test_a_batch_gives_each_stream_exactly_its_own_replies(bus: Bus, nats_url: str) -> None:
    """A responder answering several streams of one inbox sends one batch message
    (``<prefix>.batch``): each stream gets its items, in order, interleaved with the
    plain replies sent around them; an item of an unknown token or carrying another
    request's id is dropped and counted, never delivered."""
    subj, nc, seen, ready = await recorder(bus, nats_url, 3)
    streams = {rid: bus.stream(subj, b"go", idle_timeout=5, request_id=rid) for rid in "abc"}
    got, readers = read_all(streams, {"a": 4, "b": 3, "c": 1})
    try:
        await asyncio.wait_for(ready.wait(), 5)
        tok = {rid: batch_subject(reply)[1] for rid, reply in seen.items()}
        where = batch_subject(seen["a"])[0]
        assert where == batch_subject(seen["b"])[0]  # one inbox: one batch subject
        await nc.publish(seen["a"], b"a0", headers={REQUEST_ID: "a"})  # a plain one first
        await nc.publish(where, pack_batch([
            (tok["a"], "a", b"a1"), (tok["b"], "b", b"b0"), (tok["a"], "a", b"a2"),
            (tok["b"], "a", b"forged"),  # b's token, a's id: not b's
            ("0" * 32, "c", b"nobody's"),  # no such stream
        ]))
        await nc.publish(where, pack_batch([(tok["b"], "b", b"b1"), (tok["c"], "c", b"c0")]))
        await nc.publish(seen["b"], b"b2", headers={REQUEST_ID: "b"})
        await nc.publish(seen["a"], b"a3", headers={REQUEST_ID: "a"})
        await asyncio.wait_for(asyncio.gather(*readers), 5)
        assert got == {"a": [b"a0", b"a1", b"a2", b"a3"], "b": [b"b0", b"b1", b"b2"],
                       "c": [b"c0"]}
        assert bus.dropped_replies == 2
        await nc.publish(where, b"\xc1 not msgpack")  # a malformed batch: dropped, counted
        await bus.flush()
        await settle(bus, nc)
        assert bus.dropped_replies == 3
    finally:
        await close_all(readers, streams.values(), nc)


async def test_a_batch_past_max_payload_reaches_every_stream_whole(
    bus: Bus, nats_url: str
) -> None:
    """Replies for several streams totalling ~3x the server's max_payload: packed by
    ``pack_batches`` they go as several messages the server takes, and each stream gets
    every one of its replies in order (one message of them: MaxPayloadError)."""
    subj, nc, seen, ready = await recorder(bus, nats_url, 3)
    per = 3 * nc.max_payload // (3 * 4096)  # replies per stream, 4 KiB each
    streams = {rid: bus.stream(subj, b"go", idle_timeout=5, request_id=rid, max_unread=per)
               for rid in "abc"}
    got, readers = read_all(streams, dict.fromkeys(streams, per))
    try:
        await asyncio.wait_for(ready.wait(), 5)
        tok = {rid: batch_subject(reply)[1] for rid, reply in seen.items()}
        items = [(tok[rid], rid, f"{rid}{i:05d}".encode().ljust(4096, b".")) for i in range(per)
                 for rid in streams]
        messages = pack_batches(items, bus.max_payload)
        assert len(messages) >= 3 and max(map(len, messages)) <= nc.max_payload
        for data in messages:
            await nc.publish(batch_subject(seen["a"])[0], data)
        await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert bus.dropped_replies == 0
        for rid in streams:  # every reply, in order
            assert [d[:6] for d in got[rid]] == [f"{rid}{i:05d}".encode() for i in range(per)]
    finally:
        await close_all(readers, streams.values(), nc)


async def test_a_bug_in_one_streams_overflow_hook_leaves_the_batch_to_the_others(
    bus: Bus, nats_url: str
) -> None:
    """An exception while handing a batch item to its stream (here the stream's overflow
    hook raises) is logged and counted (``callback_errors["replies"]``); that stream's
    reader still gets its overflow error at once, and the batch's later items reach
    their own streams."""
    subj, nc, seen, ready = await recorder(bus, nats_url, 2)

    def hook() -> None:
        raise RuntimeError("a bug in the overflow hook")

    a = bus.stream(subj, b"go", idle_timeout=30, request_id="a", max_unread=2, on_overflow=hook)
    b = bus.stream(subj, b"go", idle_timeout=30, request_id="b")
    a_first = asyncio.ensure_future(a.__anext__())  # sends it
    b_first = asyncio.ensure_future(b.__anext__())
    try:
        await asyncio.wait_for(ready.wait(), 5)
        tok = {rid: batch_subject(reply)[1] for rid, reply in seen.items()}
        items = [(tok["a"], "a", b"a%d" % i) for i in range(4)] + [(tok["b"], "b", b"b0")]
        await nc.publish(batch_subject(seen["a"])[0], pack_batch(items))
        assert (await asyncio.wait_for(b_first, 5)).data == b"b0"
        with pytest.raises(StreamOverflow):  # its unread replies were freed: the error
            await asyncio.wait_for(a_first, 5)
        assert bus.callback_errors.get("replies") == 1
    finally:
        await close_all((a_first, b_first), (a, b), nc)
