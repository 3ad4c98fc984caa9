"""The bus against a real nats-server: inbox-before-publish, scatter, no-responders,
late replies, bounded connect, micro-service discovery."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import nats
import pytest

from shared.bus import RANK, REQUEST_ID, Bus
from shared.errors import BusUnreachable, NoResponders, Timeout


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, "test-bus")
    yield b
    await b.close()


async def connect(url: str) -> nats.aio.client.Client:
    """A raw nats-py peer. nats-py's first flush after connect can return on the
    handshake's PONG, so flush once before relying on flush."""
    nc = await nats.connect(url)
    await nc.flush()
    return nc


async def settle(bus: Bus, *peers: nats.aio.client.Client) -> None:
    """Wait until the server routes to each peer's subscriptions.

    Seen here (nats-server 2.15.1 + nats-py): a subscription of a fresh connection,
    flushed, is now and then not yet visible to another connection's publish (about 1
    in 300). Each peer answers a probe subscribed after its real ones; once every probe
    answers, the real subscriptions are routed too."""
    for nc in peers:
        probe = f"probe.{uuid.uuid4().hex}"

        async def answer(msg, nc=nc):  # noqa: ANN001
            await nc.publish(msg.reply, b"")

        await nc.subscribe(probe, cb=answer)
        await nc.flush()
        for _ in range(50):
            try:
                await bus.request(probe, b"", timeout=0.2)
                break
            except (NoResponders, Timeout):
                await asyncio.sleep(0.05)


def subject() -> str:
    return f"test.{uuid.uuid4().hex}"


async def test_thousand_back_to_back_requests_lose_nothing(bus: Bus, nats_url: str) -> None:
    # The responder answers as fast as it can, from another connection: a reply racing
    # the requester's subscription would be lost without the inbox registered first.
    responder = await connect(nats_url)
    subj = subject()

    async def echo(msg):  # noqa: ANN001
        await msg.respond(msg.data)

    await responder.subscribe(subj, cb=echo)
    await settle(bus, responder)
    try:
        results = []
        for i in range(1000):
            rep = await bus.request(subj, str(i).encode(), timeout=5)
            results.append(int(rep.data))
        assert results == list(range(1000))
        # and 1000 concurrent ones
        reps = await asyncio.gather(
            *(bus.request(subj, str(i).encode(), timeout=10) for i in range(1000))
        )
        assert [int(r.data) for r in reps] == list(range(1000))
        assert bus.dropped_replies == 0
        assert not bus._pending
    finally:
        await responder.close()


async def test_scatter_names_silent_rank(bus: Bus, nats_url: str) -> None:
    subj = subject()
    conns = []
    for rank in (0, 2):  # rank 1 never answers
        nc = await connect(nats_url)

        async def answer(msg, rank=rank, nc=nc):  # noqa: ANN001
            await nc.publish(msg.reply, b"ok", headers={RANK: str(rank)})

        await nc.subscribe(subj, queue=f"rank{rank}", cb=answer)
        conns.append(nc)
    await settle(bus, *conns)
    try:
        t0 = time.monotonic()
        with pytest.raises(Timeout) as e:
            await bus.scatter(subj, b"x", expected=3, timeout=0.5)
        assert e.value.code == 503
        assert e.value.missing == [1]
        assert "[1]" in e.value.message
        assert sorted(e.value.result["replies"]) == [0, 2]
        assert time.monotonic() - t0 < 2
    finally:
        for nc in conns:
            await nc.close()


async def test_scatter_returns_once_all_ranks_answer(bus: Bus, nats_url: str) -> None:
    subj = subject()
    nc = await connect(nats_url)
    for rank in range(4):
        # two subscribers per rank: the per-rank queue group delivers to one of them
        for _ in range(2):

            async def answer(msg, rank=rank):  # noqa: ANN001
                await nc.publish(msg.reply, str(rank).encode(), headers={RANK: str(rank)})

            await nc.subscribe(subj, queue=f"rank{rank}", cb=answer)
    await settle(bus, nc)
    try:
        t0 = time.monotonic()
        replies = await bus.scatter(subj, b"x", expected=4, timeout=5)
        assert time.monotonic() - t0 < 1
        assert {r: int(rep.data) for r, rep in replies.items()} == {0: 0, 1: 1, 2: 2, 3: 3}
    finally:
        await nc.close()


async def test_no_responders_fails_fast(bus: Bus) -> None:
    subj = subject()
    t0 = time.monotonic()
    with pytest.raises(NoResponders) as e:
        await bus.request(subj, b"x", timeout=5)
    assert e.value.code == 503
    assert time.monotonic() - t0 < 1
    # the error names the subject called, not our reply inbox
    assert subj in str(e.value) and "_INBOX" not in str(e.value)


async def test_no_responders_on_a_stream_names_the_subject(bus: Bus) -> None:
    subj = subject()
    with pytest.raises(NoResponders) as e:
        async for _ in bus.stream(subj, b"x", idle_timeout=5):
            pass
    assert subj in str(e.value) and "_INBOX" not in str(e.value)


async def test_late_reply_is_dropped_and_counted(bus: Bus, nats_url: str) -> None:
    subj = subject()
    nc = await connect(nats_url)

    async def slow(msg):  # noqa: ANN001
        await asyncio.sleep(0.4)
        await msg.respond(b"late")

    await nc.subscribe(subj, cb=slow)
    await settle(bus, nc)
    try:
        before = bus.dropped_replies
        with pytest.raises(Timeout):
            await bus.request(subj, b"x", timeout=0.1)
        await asyncio.sleep(0.6)
        assert bus.dropped_replies == before + 1
        assert not bus._pending  # nothing kept for the late reply
    finally:
        await nc.close()


async def test_request_id_header_is_sent_and_echoed(bus: Bus, nats_url: str) -> None:
    subj = subject()
    nc = await connect(nats_url)
    seen = {}

    async def answer(msg):  # noqa: ANN001
        seen.update(msg.headers or {})
        await nc.publish(msg.reply, b"ok", headers={REQUEST_ID: msg.headers[REQUEST_ID]})

    await nc.subscribe(subj, cb=answer)
    await settle(bus, nc)
    try:
        rep = await bus.request(subj, b"x", timeout=2, request_id="abc123")
        assert seen[REQUEST_ID] == "abc123" and rep.headers[REQUEST_ID] == "abc123"
    finally:
        await nc.close()


async def test_connect_to_unreachable_server_is_bounded() -> None:
    t0 = time.monotonic()
    with pytest.raises(BusUnreachable) as e:
        await Bus.connect("nats://127.0.0.1:1", "x", timeout=1.5)
    assert time.monotonic() - t0 < 4
    assert "nats://127.0.0.1:1" in e.value.message


def _open_tcp_to(port: int) -> int:
    """This process's ESTABLISHED TCP sockets to 127.0.0.1:``port`` (Linux /proc)."""
    import os

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    n = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            remote, state, inode = cols[2], cols[3], cols[9]
            if state == "01" and int(remote.split(":")[1], 16) == port and inode in mine:
                n += 1
    return n


async def test_cancelled_connect_leaves_no_connection(nats_url: str) -> None:
    """A caller cancelled at any point of Bus.connect (mid-handshake included) leaves no
    socket open to the server: nats-py does not close its transport when cancelled."""
    import gc
    from urllib.parse import urlparse

    port = urlparse(nats_url).port
    assert port
    before = _open_tcp_to(port)
    for k in range(80):  # cancel after k loop iterations, then after k/4 ms: every
        task = asyncio.ensure_future(Bus.connect(nats_url, f"cancel-{k}", timeout=5))
        if k < 40:  # await of the handshake is hit by one of them
            for _ in range(k):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep((k - 40) / 4000)
        task.cancel()
        res = (await asyncio.gather(task, return_exceptions=True))[0]
        if isinstance(res, Bus):  # connected before the cancel landed: the caller owns it
            await res.close()
    await asyncio.sleep(0.3)
    gc.collect()
    await asyncio.sleep(0.1)
    assert _open_tcp_to(port) == before


async def test_served_endpoints_are_discoverable_micro_services(bus: Bus, nats_url: str) -> None:
    name = f"rollbus-test-{uuid.uuid4().hex[:8]}"
    svc = await bus.add_service(name, "0.1.0")
    subj = subject()

    async def handler(data: bytes, headers: dict[str, str]) -> bytes:
        return data.upper()

    await bus.serve(svc, "up", subj, handler, queue="q", reply_headers={RANK: "0"})
    rep = await bus.request(subj, b"hi", timeout=2, request_id="rid1")
    assert rep.data == b"HI" and rep.headers[REQUEST_ID] == "rid1"
    nc = await connect(nats_url)
    try:
        ping = await nc.request(f"$SRV.PING.{name}", b"", timeout=2)
        assert json.loads(ping.data)["name"] == name
        info = json.loads((await nc.request(f"$SRV.INFO.{name}", b"", timeout=2)).data)
        assert info["endpoints"][0]["subject"] == subj
    finally:
        await nc.close()


async def test_an_oversized_message_fails_alone_and_the_connection_survives(
    bus: Bus, nats_url: str
) -> None:
    """nats-py checks a publish's payload against ``max_payload`` but not its headers: a
    larger message went out, the server closed the connection and nats-py never
    reconnected (one reply echoing a huge request id cut the engine off the bus)."""
    big = "x" * (bus.max_payload // 2 + 1)
    with pytest.raises(nats.errors.MaxPayloadError):
        await bus.publish(subject(), big.encode(), headers={"X-Big": big})
    svc = await bus.add_service(f"rollbus-test-{uuid.uuid4().hex[:8]}", "0.1.0")
    subj = subject()

    async def handler(data: bytes, headers: dict[str, str]) -> bytes:
        return data + data

    await bus.serve(svc, "echo", subj, handler, queue="q")
    nc = await connect(nats_url)
    try:
        # a request id too long to echo (its reply with it would pass max_payload):
        # answered, without it
        part = "y" * (bus.max_payload * 2 // 5)
        rep = await nc.request(subj, part.encode(), timeout=5, headers={REQUEST_ID: part})
        assert rep.data == 2 * part.encode() and REQUEST_ID not in (rep.headers or {})
    finally:
        await nc.close()
    assert bus.nc.is_connected
    rep = await bus.request(subj, b"still here", timeout=5, request_id="r2")
    assert rep.data == b"still here" * 2 and rep.headers[REQUEST_ID] == "r2"
