"""Correlation against a real nats-server: a caller's request id is never a subject
token (any string works, duplicates never cross), and a streamed request keeps at most
``max_unread`` replies for a slow reader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shared.bus import REQUEST_ID, Bus, StreamOverflow
from tests.integration.shared.test_bus import connect, settle, subject

ODD_IDS = ["a.b", "*", ">", "a b", "a.*.>", "ünïcødé ✓", "x" * 1024, "", "~2E"]


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, "test-bus-corr")
    yield b
    await b.close()


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
