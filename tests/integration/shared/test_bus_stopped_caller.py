"""A caller stopped past its own reply timer does not blame its peer.

A real caller process (``stopped_caller.py``: one :class:`Bus` call) is SIGSTOPped by
the responder as soon as its request arrives; the responder(s) answer while it is
stopped, and it is continued only after its timer is due. asyncio then runs the due
timer in the same loop turn as the socket's read event, before nats-py has parsed the
replies waiting there: without the bus's settle (a PING/PONG, then the inbox drained)
the call raised ``Timeout`` — an engine stopped past its scatter to the ranks rolled
back an update every rank had made (``tests/faults/test_stalls.py``)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.bus import RANK, REQUEST_ID, Bus
from shared.errors import Timeout
from tests.e2e.procs import wait_stopped
from tests.integration.shared.test_bus import connect, settle, subject

ROOT = Path(__file__).resolve().parents[3]
CALLER = Path(__file__).with_name("stopped_caller.py")
TIMEOUT = 1.0  # the caller's reply timeout
HELD = TIMEOUT + 1.0  # stopped this long from its request's arrival: its timer is due


@pytest.mark.parametrize("mode", ["request", "scatter", "stream"])
async def test_a_caller_stopped_past_its_timer_gets_the_replies_it_was_sent(
    nats_url: str, mode: str
) -> None:
    subj = subject()
    nc = await connect(nats_url)
    stopped: asyncio.Future[float] | None = None  # when the caller was stopped

    async def stop(pid: int) -> float:
        os.kill(pid, signal.SIGSTOP)
        await asyncio.to_thread(wait_stopped, pid)
        return time.monotonic()

    async def answer(msg, rank: int) -> None:  # noqa: ANN001
        nonlocal stopped
        if stopped is None:
            stopped = asyncio.ensure_future(stop(int(msg.data)))
        await stopped  # every reply goes out while the caller is stopped
        headers = {REQUEST_ID: msg.headers[REQUEST_ID], RANK: str(rank)}
        await nc.publish(msg.reply, f"rank {rank}".encode(), headers=headers)
        await nc.flush()

    for rank in range(2 if mode == "scatter" else 1):
        await nc.subscribe(subj, queue=f"r{rank}", cb=functools.partial(answer, rank=rank))
    probe = await Bus.connect(nats_url, "probe")
    await settle(probe, nc)  # the responders are routed before the caller asks
    await probe.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(CALLER), nats_url, mode, subj, str(TIMEOUT)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        for _ in range(600):  # the caller's start (imports) on a loaded host
            if stopped is not None:
                break
            await asyncio.sleep(0.05)
        assert stopped is not None, "the request never arrived"
        since = await stopped
        await asyncio.sleep(HELD)
        assert time.monotonic() - since >= TIMEOUT  # its timer is due when it goes on
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
        got = json.loads(out)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
        await nc.close()
    want = ["rank 0", "rank 1"] if mode == "scatter" else ["rank 0"]
    assert got.get("got") == want, got
    assert got["waited"] >= TIMEOUT, got  # by its own clock too: the timer had fired


async def test_timers_firing_together_settle_with_one_ping(nats_url: str) -> None:
    """Genuine timeouts (nobody answers) still raise ``Timeout``; those firing in the
    same loop turn (e.g. the engine's reply probes, one per live request) share one
    PING/PONG instead of one each."""
    subj = subject()
    nc = await connect(nats_url)

    async def silent(msg):  # noqa: ANN001 - a reader that never answers
        return None

    await nc.subscribe(subj, cb=silent)
    bus = await Bus.connect(nats_url, "settle-once")
    await settle(bus, nc)
    pings = 0
    flush = bus.nc.flush

    async def counted(*args: object, **kw: object) -> None:
        nonlocal pings
        pings += 1
        await flush(*args, **kw)  # type: ignore[arg-type]

    bus.nc.flush = counted  # type: ignore[method-assign]
    try:
        sent = [await bus.send(subj, b"x") for _ in range(5)]  # one timer deadline each
        got = await asyncio.gather(*(s.reply(0.2) for s in sent), return_exceptions=True)
        assert all(isinstance(g, Timeout) for g in got), got
        assert pings == 1
        assert bus.pending == 0
    finally:
        await bus.close()
        await nc.close()
