"""``Sent.reply``'s own timer (session 12: one loop timer, not ``wait_for``) over a real
nats-server: a request cancelled by its caller, or answered, leaves nothing behind — no
pending entry, no live timer in the loop — and a reply that comes after the cancel is
dropped as unknown, never delivered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from shared.bus import REQUEST_ID, Bus, _expire
from tests.integration.shared.test_bus import connect, settle, subject


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, "test-bus-timer")
    yield b
    await b.close()


def live_expiry_timers() -> list[Any]:
    """The loop's scheduled, not cancelled, ``_expire`` timers (one per waiting request)."""
    loop: Any = asyncio.get_running_loop()
    return [h for h in loop._scheduled if not h.cancelled() and h._callback is _expire]


async def test_a_cancelled_request_leaves_no_timer_nor_pending_entry(
    bus: Bus, nats_url: str
) -> None:
    subj = subject()
    nc = await connect(nats_url)
    held: list[Any] = []
    arrived = asyncio.Event()

    async def hold(msg):  # noqa: ANN001 - answered only when the test says so
        held.append(msg)
        arrived.set()

    await nc.subscribe(subj, cb=hold)
    await settle(bus, nc)
    try:
        task = asyncio.create_task(bus.request(subj, b"x", timeout=3600))
        await asyncio.wait_for(arrived.wait(), 10)
        assert bus.pending == 1 and len(live_expiry_timers()) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert bus.pending == 0
        assert live_expiry_timers() == []  # an hour-long timer would outlive its request
        # the responder answers after all: dropped, not delivered to a later request
        dropped = bus.dropped_replies
        msg = held[0]
        await nc.publish(msg.reply, b"late", headers={REQUEST_ID: msg.headers[REQUEST_ID]})
        await nc.flush()
        for _ in range(200):
            if bus.dropped_replies > dropped:
                break
            await asyncio.sleep(0.01)
        assert bus.dropped_replies == dropped + 1
    finally:
        await nc.close()


async def test_an_answered_request_leaves_no_timer(bus: Bus, nats_url: str) -> None:
    subj = subject()
    nc = await connect(nats_url)

    async def echo(msg):  # noqa: ANN001
        await nc.publish(msg.reply, msg.data, headers={REQUEST_ID: msg.headers[REQUEST_ID]})

    await nc.subscribe(subj, cb=echo)
    await settle(bus, nc)
    try:
        rep = await bus.request(subj, b"ok", timeout=3600)
        assert rep.data == b"ok"
        assert bus.pending == 0 and live_expiry_timers() == []
    finally:
        await nc.close()
