"""A step's reply that came while the engine was not running (stopped, or starved of
CPU, past ``CONTROL_TIMEOUT_S``) is taken, not blamed on the ranks.

The engine's :class:`~services.engine.generation.Generation` waits for a step's reply on
a real bus (real nats-server); a stand-in rank on its own event loop (a thread) answers
at once, while the test holds the engine's loop — as SIGSTOP holds its process — until
past the step's timeout. Then the step loop's own timer runs before nats-py has read the
reply waiting in the socket: without the bus's settle (PING/PONG) the step failed with
``Timeout`` and every live request with it."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import nats
import pytest

from services.engine.ranks import RankView
from shared.bus import REQUEST_ID, Bus
from tests.unit.engine.test_step_lock import engine

CT = 0.5  # the engine's CONTROL_TIMEOUT_S here


class StandInRank:
    """Answers every message on ``subject`` at once, from its own loop and connection."""

    def __init__(self, url: str, subject: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.answered = threading.Event()
        self.nc = asyncio.run_coroutine_threadsafe(self._start(url, subject), self.loop).result(30)

    async def _start(self, url: str, subject: str) -> nats.aio.client.Client:
        nc = await nats.connect(url)

        async def answer(msg):  # noqa: ANN001
            await nc.publish(msg.reply, b"step done", headers={REQUEST_ID: msg.headers[REQUEST_ID]})
            await nc.flush()
            self.answered.set()

        await nc.subscribe(subject, cb=answer)
        await nc.flush()
        return nc

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def subject() -> str:
    return f"test.step.{uuid.uuid4().hex}"


@pytest.fixture
def rank(nats_url: str, subject: str) -> Iterator[StandInRank]:
    r = StandInRank(nats_url, subject)
    yield r
    r.stop()


async def test_a_step_reply_read_late_by_the_engine_is_taken(
    nats_url: str, subject: str, rank: StandInRank
) -> None:
    eng = engine(SimpleNamespace(view=RankView(2, 0.25)))
    eng.settings.control_timeout_s = CT
    eng.bus = await Bus.connect(nats_url, "engine")
    try:
        sent = await eng.bus.send(subject, b"step 1")
        # the step's wait begins (its timer armed), then the engine's loop is held
        waiting = asyncio.ensure_future(eng.scheduler._reply(sent, 1, {0: 1, 1: 2}))
        await asyncio.sleep(0)
        assert rank.answered.wait(10)  # the loop held: the reply waits in the socket
        time.sleep(CT + 0.3)  # noqa: ASYNC251 - holding the loop is the point
        rep = await waiting
        assert rep.data == b"step done"
    finally:
        await eng.bus.close()
