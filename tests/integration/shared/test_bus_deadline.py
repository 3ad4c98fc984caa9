"""``Rollbus-Deadline`` over a real nats-server: every request the bus sends carries its
caller's deadline; a ``deadline`` endpoint drops one that arrives past it before its
handler runs (counted), and serves one without the header (the nats CLI) as before."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import nats
import pytest

from shared.bus import DEADLINE, REQUEST_ID, Bus


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, "test-deadline")
    yield b
    await b.close()


async def _served(bus: Bus, deadline: bool) -> tuple[str, list[dict[str, str]]]:
    """A served subject and the headers of every request its handler ran for."""
    seen: list[dict[str, str]] = []

    async def handler(data: bytes, headers: dict[str, str]) -> bytes:
        seen.append(headers)
        return b"ok"

    svc = await bus.add_service(f"rollbus-test-{uuid.uuid4().hex[:8]}", "0.1.0")
    subj = f"test.{uuid.uuid4().hex}"
    await bus.serve(svc, "ep", subj, handler, queue="q", deadline=deadline)
    await bus.flush()
    return subj, seen


async def test_request_carries_its_callers_deadline(bus: Bus) -> None:
    subj, seen = await _served(bus, deadline=True)
    t0 = time.time()
    assert (await bus.request(subj, b"", timeout=7.0)).data == b"ok"
    at = int(seen[0][DEADLINE]) / 1000
    assert t0 + 7.0 - 0.5 <= at <= time.time() + 7.0


async def test_late_request_is_dropped_before_its_handler(bus: Bus, nats_url: str) -> None:
    subj, seen = await _served(bus, deadline=True)
    nc = await nats.connect(nats_url)
    try:
        past = str(int(time.time() * 1000) - 1)
        with pytest.raises(nats.errors.TimeoutError):  # not answered: its caller is gone
            await nc.request(subj, b"", timeout=0.5, headers={DEADLINE: past})
        assert seen == [] and bus.expired_requests == 1
        # no header (the nats CLI, a raw client): served as before
        assert (await nc.request(subj, b"", timeout=2)).data == b"ok"
        future = str(int(time.time() * 1000) + 60_000)
        rep = await nc.request(subj, b"", timeout=2, headers={DEADLINE: future, REQUEST_ID: "r"})
        assert rep.data == b"ok" and len(seen) == 2 and bus.expired_requests == 1
    finally:
        await nc.close()


async def test_endpoint_without_deadline_serves_late_requests(bus: Bus, nats_url: str) -> None:
    subj, seen = await _served(bus, deadline=False)
    nc = await nats.connect(nats_url)
    try:
        past = str(int(time.time() * 1000) - 1)
        assert (await nc.request(subj, b"", timeout=2, headers={DEADLINE: past})).data == b"ok"
        assert len(seen) == 1 and bus.expired_requests == 0
    finally:
        await nc.close()


async def test_late_subscribed_request_is_dropped(bus: Bus, nats_url: str) -> None:
    got: list[bytes] = []

    async def cb(msg: nats.aio.msg.Msg) -> None:
        got.append(msg.data)
        await bus.publish(msg.reply, b"ok")

    subj = f"test.{uuid.uuid4().hex}"
    await bus.subscribe(subj, cb, deadline=True)
    await bus.flush()
    nc = await nats.connect(nats_url)
    try:
        past = str(int(time.time() * 1000) - 1)
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(subj, b"late", timeout=0.5, headers={DEADLINE: past})
        rep = await bus.request(subj, b"on time", timeout=2)  # stamps its own deadline
        assert rep.data == b"ok" and got == [b"on time"] and bus.expired_requests == 1
    finally:
        await nc.close()
