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
from shared.errors import ControlError, Timeout
from tests.e2e.procs import wait_stopped
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


def _leftovers(bus: Bus) -> dict[str, int]:
    """What a finished call must not leave behind (the bus's tables, settles, PONGs)."""
    return {
        "pending": len(bus._pending),
        "rids": len(bus._rids),
        "subjects": len(bus._subjects),
        "settles": len(bus._settles),
        "pongs": len(bus.nc._pongs),
    }


async def test_callers_cancelled_while_settling_leave_nothing_and_others_still_time_out(
    server: natsd.NatsServer,
) -> None:
    """The server stopped: every settle waits for its PONG. Callers cancelled meanwhile
    (request, scatter, stream) get ``CancelledError`` and leave no table entry; the
    others sharing the same PING still end with ``Timeout``; once the server is back,
    the PONGs of the given-up flushes are consumed and later calls work."""
    bus = await Bus.connect(server.url, "settle-cancel")
    peer = await Bus.connect(server.url, "settle-silent")
    subj = subject()

    async def silent(msg) -> None:  # noqa: ANN001 - a reader that never answers
        return None

    await peer.nc.subscribe(subj, cb=silent)
    await peer.nc.flush()
    await bus.flush()
    try:
        server.proc.send_signal(signal.SIGSTOP)
        await asyncio.to_thread(wait_stopped, server.proc.pid)

        async def stream() -> None:
            async for _ in bus.stream(subj, b"x", idle_timeout=0.1):
                pass

        calls = [
            asyncio.ensure_future(bus.request(subj, b"x", timeout=0.1)),
            asyncio.ensure_future(bus.scatter(subj, b"x", expected=2, timeout=0.1)),
            asyncio.ensure_future(stream()),
        ]
        kept = [asyncio.ensure_future(bus.request(subj, b"x", timeout=0.1)) for _ in range(3)]
        while len(bus._settles) == 0:  # the timers fired: they wait in the settle now
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert all(not c.done() for c in calls + kept)
        for c in calls:
            c.cancel()
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(g, asyncio.CancelledError) for g in got), got
        ended = await asyncio.gather(*kept, return_exceptions=True)
        assert all(isinstance(e, Timeout) for e in ended), ended
        assert {k: v for k, v in _leftovers(bus).items() if k != "pongs"} == {
            "pending": 0,
            "rids": 0,
            "subjects": 0,
            "settles": 0,
        }
        server.proc.send_signal(signal.SIGCONT)
        await bus.flush()  # its PONG is its own, after the given-up ones
        assert _leftovers(bus) == dict.fromkeys(_leftovers(bus), 0)
        with pytest.raises(Timeout):
            await bus.request(subj, b"x", timeout=0.05)  # nobody answers: a genuine one
    finally:
        server.proc.send_signal(signal.SIGCONT)
        await peer.close()
        await bus.close()


async def test_thousands_of_timeouts_leave_nothing_behind(server: natsd.NatsServer) -> None:
    """Genuine timeouts (a reader that never answers) by the thousand: every table, the
    settles and nats-py's PONG queue are empty after, and each late reply is dropped
    and counted."""
    bus = await Bus.connect(server.url, "settle-many")
    peer = await Bus.connect(server.url, "settle-peer")
    subj = subject()
    held: list[object] = []

    async def hold(msg) -> None:  # noqa: ANN001 - answered late, by the test
        held.append(msg)

    sub = await peer.nc.subscribe(subj, cb=hold)
    await peer.nc.flush()
    try:
        for _ in range(20):
            sent = [await bus.send(subj, b"x") for _ in range(100)]
            got = await asyncio.gather(*(s.reply(0.01) for s in sent), return_exceptions=True)
            assert all(isinstance(g, Timeout) for g in got), got[:3]
        for _ in range(100):
            with pytest.raises(Timeout):
                await bus.scatter(subj, b"x", expected=2, timeout=0.01)
            with pytest.raises(Timeout):
                async for _ in bus.stream(subj, b"x", idle_timeout=0.01):
                    pass
        assert _leftovers(bus) == dict.fromkeys(_leftovers(bus), 0)
        await sub.unsubscribe()
        dropped = bus.dropped_replies
        for msg in held[:500]:
            await peer.nc.publish(msg.reply, b"late", headers=dict(msg.headers))  # type: ignore[attr-defined]
        await peer.nc.flush()
        await bus.flush()
        for _ in range(200):
            if bus.dropped_replies - dropped == 500:
                break
            await asyncio.sleep(0.01)
        assert bus.dropped_replies - dropped == 500
        assert _leftovers(bus) == dict.fromkeys(_leftovers(bus), 0)
    finally:
        await peer.close()
        await bus.close()


@pytest.mark.parametrize("mode", ["request", "scatter", "stream"])
async def test_a_connection_lost_while_settling_ends_the_wait_at_once(
    server: natsd.NatsServer, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A timer fired and its settle waits for the PONG of a stopped server; the server
    dies: the connection is lost, and the caller hears it then (503, the connection
    named), not once the settle's own bound has passed (made 30 s here: nats-py drops
    the PONG's future at the reconnect, so nothing else ends that wait)."""
    monkeypatch.setattr("shared.bus.SETTLE_PONG_S", 30)
    bus = await Bus.connect(server.url, "settle-lost")
    subj = subject()

    async def call() -> object:
        if mode == "request":
            return await bus.request(subj, b"x", timeout=0.1)
        if mode == "scatter":
            return await bus.scatter(subj, b"x", expected=2, timeout=0.1)
        async for _ in bus.stream(subj, b"x", idle_timeout=0.1):
            pass
        return None

    try:
        server.proc.send_signal(signal.SIGSTOP)
        await asyncio.to_thread(wait_stopped, server.proc.pid)
        waiting = asyncio.ensure_future(call())
        while not bus._settles:  # its timer fired: it waits in the settle now
            await asyncio.sleep(0.02)
        server.proc.kill()
        killed = time.monotonic()
        with pytest.raises(ControlError) as e:
            await asyncio.wait_for(waiting, 20)
        took = time.monotonic() - killed
        assert "connection was lost" in e.value.message, e.value.message
        assert took < 10, f"{took:.1f}s after the connection was lost"
        assert bus.pending == 0
    finally:
        await bus.close()
