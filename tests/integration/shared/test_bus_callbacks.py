"""A callback that raises inside the bus is logged at ERROR with its traceback and
counted, and the subscription keeps working (real nats-server)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.msg import Msg

from shared.bus import Bus
from shared.errors import ControlError


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


@pytest.mark.parametrize("concurrent", [False, True])
async def test_serve_handler_error_is_logged_and_counted(
    nats_url: str, caplog: pytest.LogCaptureFixture, concurrent: bool
) -> None:
    bus = await Bus.connect(nats_url, "test-serve")

    async def handler(data: bytes, headers: dict[str, str]) -> bytes:
        raise RuntimeError("handler bug")

    subj = f"t.serve.{int(concurrent)}"
    try:
        svc = await bus.add_service("t-serve", "0.0.1")
        await bus.serve(svc, "x", subj, handler, queue="q", concurrent=concurrent)
        await bus.flush()
        with caplog.at_level(logging.ERROR):
            if concurrent:  # no answer can come: the caller times out, the bug is logged
                with pytest.raises(ControlError):
                    await bus.request(subj, b"{}", timeout=0.5)
            else:  # nats micro answers a 500 at once
                rep = await bus.request(subj, b"{}", timeout=5)
                assert rep.headers.get("Nats-Service-Error-Code") == "500"
        assert bus.callback_errors == {subj: 1}
        assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
    finally:
        await bus.close()
