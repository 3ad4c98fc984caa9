"""A callback that raises inside the bus is logged at ERROR with its traceback and
counted, and the subscription keeps working (real nats-server)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.msg import Msg

from shared.bus import Bus


async def test_subscribe_callback_error_is_logged_at_error_and_counted(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    bus = await Bus.connect(nats_url, "test-cb")
    seen: list[bytes] = []
    got = asyncio.Event()

    async def cb(msg: Msg) -> None:
        if msg.data == b"bad":
            raise ValueError("bad message")
        seen.append(msg.data)
        got.set()

    try:
        with caplog.at_level(logging.DEBUG):
            await bus.subscribe("t.cb.errors", cb)
            await bus.flush()
            await bus.publish("t.cb.errors", b"bad")
            await bus.publish("t.cb.errors", b"good")
            await asyncio.wait_for(got.wait(), 5)
        assert seen == [b"good"]  # the subscription survived
        assert bus.callback_errors == {"t.cb.errors": 1}
        errs = [r for r in caplog.records if "bad message" in str(r.exc_info)]
        assert errs and all(r.levelno == logging.ERROR for r in errs)
    finally:
        await bus.close()
