"""A rank refuses the commit of an update whose rollback it has received, whatever order
its handlers run in: the rollback's update id is recorded the moment the message arrives
(not when its paddle work gets its turn), and a commit runs only after a bus barrier, so
a rollback the server relayed before the commit runs is always seen by it.

One real rank server (``WorkerServer``, tiny in-memory weights) on a real nats-server, on
its own event-loop thread so the test can hold that loop (as SIGSTOP holds a rank
process) or its paddle thread while messages reach it; the engine's side is a raw bus
client sending ``worker.ctl.*`` requests in the order each test forces."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from services.worker import control
from services.worker.main import WorkerServer
from services.worker.weights import LoadedShard, WeightStore
from shared import messages as m
from shared.bus import Bus
from shared.settings import Settings
from shared.subjects import Subjects

INSTANCE = "latecommit"
DELAY = 0.3  # the rank's test window before a commit (ROLLBUS_TEST_COMMIT_DELAY_S)
SUBJECTS = Subjects(INSTANCE)


def source(version: str, verify: bool | None, expected: Any = None) -> LoadedShard:
    """Version ``vN``: one tensor full of N."""
    w = np.full(8, float(version.removeprefix("v")), np.float32)
    return LoadedShard(version, {"w": w}, [], w.nbytes)


class RankThread:
    """A rank server on its own event loop, in a thread."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.delaying = threading.Event()  # set when the rank enters its commit window
        self.server: WorkerServer = self.run(self._start(url))

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self, url: str) -> WorkerServer:
        settings = Settings(instance=INSTANCE, nats_url=url, control_timeout_s=5)
        weights = WeightStore(0, source)
        weights.load_initial("v0")
        kv = SimpleNamespace(allocated=False, nbytes=0)
        state = control.Rank(0, 1, None, weights, kv, SimpleNamespace(alive=True), "snapshot")  # type: ignore[arg-type]
        server = WorkerServer(settings, 0, state, await Bus.connect(url, "rank0"))
        await server.start()
        return server

    @staticmethod
    def _hold(run: Callable[[Callable[[], None]], Any]) -> threading.Event:
        """``run`` a job that blocks until the returned event is set; returns once it
        blocks."""
        held, release = threading.Event(), threading.Event()

        def block() -> None:
            held.set()
            release.wait(30)

        run(block)
        assert held.wait(10)
        return release

    def hold_loop(self) -> threading.Event:
        """Block the rank's event loop (nothing it reads is handled)."""
        return self._hold(self.loop.call_soon_threadsafe)

    def hold_paddle(self) -> threading.Event:
        """Keep the rank's paddle thread busy."""
        return self._hold(self.server.pool.submit)

    def close(self) -> None:
        self.run(self.server.bus.close())
        self.server.pool.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Window(logging.Handler):
    def __init__(self, rank: RankThread) -> None:
        super().__init__()
        self.rank = rank

    def emit(self, record: logging.LogRecord) -> None:
        if "test delay before commit" in record.getMessage():
            self.rank.delaying.set()


@pytest.fixture(scope="module")
def rank(nats_url: str) -> Iterator[RankThread]:
    r = RankThread(nats_url)
    handler = Window(r)
    logging.getLogger("rollbus.worker").addHandler(handler)
    try:
        yield r
    finally:
        logging.getLogger("rollbus.worker").removeHandler(handler)
        r.close()


async def send(bus: Bus, method: str, args: msgspec.Struct | None = None) -> Any:
    data = m.json_encode(args) if args is not None else b"{}"
    return await bus.send(SUBJECTS.worker_ctl(method), data)


async def answer(pending: Any) -> m.WorkerReply:
    return m.json_decode((await pending.reply(10)).data, type=m.WorkerReply)


async def call(bus: Bus, method: str, args: msgspec.Struct | None = None) -> m.WorkerReply:
    return await answer(await send(bus, method, args))


async def staged(bus: Bus, uid: str) -> None:
    """The rank on v0 with v1 staged as update ``uid``."""
    assert (await call(bus, "status")).result["version"] == "v0"
    rep = await call(bus, "stage", m.StageArgs("v1", None, "snapshot", uid))
    assert rep.error_code == 200, rep


async def assert_on_v0(bus: Bus, rank: RankThread) -> None:
    """``status`` says v0 and the tensors served are v0's."""
    assert (await call(bus, "status")).result["version"] == "v0"
    w = rank.server.state.weights.current
    assert w is not None and float(w["w"].numpy()[0]) == 0.0


def assert_refused(rep: m.WorkerReply, uid: str) -> None:
    assert rep.error_code == 409 and f"update {uid} was rolled back" in rep.error_message, rep


@pytest.fixture
async def engine(nats_url: str, rank: RankThread) -> Any:
    rank.server.test_delays["commit"] = 0.0
    rank.delaying.clear()
    bus = await Bus.connect(nats_url, "engine")
    try:
        yield bus
    finally:
        await bus.close()


async def test_rollback_received_while_the_commit_waits_for_the_paddle_thread(
    engine: Bus, rank: RankThread
) -> None:
    """The bad order: the commit is dispatched first (its paddle work queued), the
    rollback after it; the paddle thread then runs them in that order. The commit is
    refused: the rollback's id was recorded when it arrived."""
    await staged(engine, "u-busy")
    release = rank.hold_paddle()
    try:
        commit = await send(engine, "commit", m.CommitArgs("v1", "u-busy"))
        rollback = await send(engine, "rollback", m.UpdateIdArgs("u-busy"))
        # a ping answered after both were sent: the rank has dispatched both
        assert (await call(engine, "ping")).result["version"] == "v0"
    finally:
        release.set()
    assert_refused(await answer(commit), "u-busy")
    rep = await answer(rollback)
    assert rep.error_code == 200 and rep.result == {**rep.result, "rolled_back": False}, rep
    await assert_on_v0(engine, rank)


async def test_rollback_in_the_socket_while_the_stopped_rank_would_commit(
    engine: Bus, rank: RankThread
) -> None:
    """The SIGSTOP case: the rank received the commit (it sits in its commit window),
    then its event loop is held; the rollback reaches its socket meanwhile and the window
    expires. When the loop runs again, the commit's timer and the unread rollback race:
    the bus barrier makes the rollback be read (and recorded) before the commit runs."""
    rank.server.test_delays["commit"] = DELAY
    await staged(engine, "u-stop")
    commit = await send(engine, "commit", m.CommitArgs("v1", "u-stop"))
    assert await asyncio.to_thread(rank.delaying.wait, 10)
    release = rank.hold_loop()
    try:
        rollback = await send(engine, "rollback", m.UpdateIdArgs("u-stop"))
        await engine.flush()
        await asyncio.sleep(DELAY + 0.2)  # the window has expired; the rollback is relayed
    finally:
        release.set()
    assert_refused(await answer(commit), "u-stop")
    assert (await answer(rollback)).error_code == 200
    await assert_on_v0(engine, rank)


async def test_rollback_handled_before_the_commit(engine: Bus, rank: RankThread) -> None:
    await staged(engine, "u-first")
    rep = await call(engine, "rollback", m.UpdateIdArgs("u-first"))
    assert rep.error_code == 200 and rep.result["rolled_back"] is False, rep
    assert_refused(await call(engine, "commit", m.CommitArgs("v1", "u-first")), "u-first")
    await assert_on_v0(engine, rank)


async def test_commit_in_time_then_rollback_swaps_back(engine: Bus, rank: RankThread) -> None:
    """A commit the rank ran before any rollback arrived is undone by the rollback."""
    await staged(engine, "u-timely")
    rep = await call(engine, "commit", m.CommitArgs("v1", "u-timely"))
    assert rep.error_code == 200 and rep.result["version"] == "v1", rep
    assert (await call(engine, "status")).result["version"] == "v1"
    rep = await call(engine, "rollback", m.UpdateIdArgs("u-timely"))
    assert rep.error_code == 200 and rep.result["rolled_back"] is True, rep
    await assert_on_v0(engine, rank)
