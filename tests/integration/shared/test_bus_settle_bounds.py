"""The settle of a fired reply timer (:meth:`Bus.settle`) stays within its bound
(``SETTLE_PONG_S + SILENCE_GRACE_S``) whatever state nats-py is in, over a real
nats-server that is SIGSTOPped.

nats-py's ``flush(timeout)`` starts its timer only after the PING is queued for its
flusher task, in a queue of at most 1024 entries. While the server is stopped and this
process has sent more than the sockets hold (a busy API: prompts still coming in), the
flusher sits in the socket's drain, each settle's PING adds an entry that stays, and
after 1024 of them a settle waited in that queue with no timer at all: every request
whose timer fired from then on hung until the server came back, not ``Timeout``."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services import natsd
from shared.bus import SETTLE_PONG_S, SILENCE_GRACE_S, Bus
from shared.errors import Timeout
from tests.integration.shared.test_bus import subject

FLUSHER_QUEUE = 1024  # nats-py's DEFAULT_MAX_FLUSHER_QUEUE_SIZE


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[natsd.NatsServer]:
    srv = natsd.start(tmp_path / "nats", port=0)
    try:
        yield srv
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()


async def test_requests_timing_out_on_a_stopped_server_never_hang(
    server: natsd.NatsServer,
) -> None:
    bus = await Bus.connect(server.url, "settle-bounds")
    stopped = False
    calls: list[asyncio.Future[object]] = []
    try:
        server.proc.send_signal(signal.SIGSTOP)
        stopped = True
        # more than the sockets hold: nats-py's flusher now waits in the drain
        big = b"x" * (bus.max_payload - 4096)
        for _ in range(64):
            await bus.publish(subject(), big)
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        # timers firing in loop turns of their own (a busy process: stream idle timers,
        # probes, polls): one settle, one PING each, more than the flusher's queue holds
        settles: list[asyncio.Future[None]] = []
        for _ in range(FLUSHER_QUEUE + 50):
            settles.append(asyncio.ensure_future(bus.settle()))
            await asyncio.sleep(0)  # the next one in a later turn: a PING of its own
        timeout = 0.05
        t0 = time.monotonic()
        call = asyncio.ensure_future(bus.request(subject(), b"x", timeout=timeout))
        calls += [call, *settles]
        # the server still stopped: it ends within its timeout and the settle's bound
        # (with room for a loaded host), never waits for the server
        bound = timeout + SETTLE_PONG_S + SILENCE_GRACE_S + 5
        done, _ = await asyncio.wait([call, *settles], timeout=bound)
        assert call in done, f"the request still waiting {time.monotonic() - t0:.1f}s on"
        assert isinstance(call.exception(), Timeout), call.exception()
        assert len(done) == len(settles) + 1, f"{len(settles) + 1 - len(done)} settles hang"
        assert bus.pending == 0
    finally:
        if stopped:
            server.proc.send_signal(signal.SIGCONT)
        await asyncio.gather(*calls, return_exceptions=True)
        await bus.close()
