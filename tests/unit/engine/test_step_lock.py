"""Scheduler changes and rank-state changes happen only under the step lock; the
step loop's stall watermark; a rank's step-gap check."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.engine import control
from services.engine.generation import Generation
from services.engine.state import EngineState
from services.worker.stepper import Stepper, Watermark
from shared import messages as m
from tests.unit.engine.test_update_flow import ScriptedRanks


def engine(ranks: Any = None) -> Any:
    async def nothing(*_: Any, **__: Any) -> None:
        return None

    model_dir = Path(tempfile.mkdtemp(prefix="rollbus-steplock-"))
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 258}))
    settings = SimpleNamespace(
        model_dir=model_dir,
        max_model_len=256,
        kv_cache_blocks=16,
        kv_block_size=16,
        max_batch_size=8,
        max_step_tokens=256,
        stall_s=5.0,
        control_timeout_s=10.0,
        load_strategy="snapshot",
        shutdown_comm_group_if_worker_idle=False,
        use_cudagraph=False,
    )
    state = EngineState(weight_version="v0")
    eng = SimpleNamespace(
        settings=settings,
        state=state,
        ranks=ranks or ScriptedRanks(),
        latest_published="",
        state_changed=nothing,
        event=nothing,
    )
    eng.scheduler = Generation(eng)  # type: ignore[arg-type]
    return eng


async def test_scheduler_changes_refuse_to_run_outside_the_step_lock() -> None:
    gen = engine().scheduler
    for change in (gen.resume, gen.drop_kv, lambda: gen.weights_changed("v1")):
        with pytest.raises(RuntimeError, match="outside the step lock"):
            change()
    async with gen.quiet():
        gen.drop_kv()
        gen.resume()
    assert gen.admit and gen.run


@pytest.mark.parametrize("method", ["update_weights", "sleep", "wakeup"])
async def test_rank_changes_wait_for_the_step_in_flight(method: str) -> None:
    eng = engine()
    gen = eng.scheduler
    if method == "update_weights":
        eng.state.pause("keep")
        call = control.update_weights(eng, m.UpdateWeightsArgs(version="v1"))
    elif method == "sleep":
        eng.state.pause("keep")
        call = control.sleep(eng, m.TagArgs())
    else:
        eng.state.sleep(("weight", "kv_cache"))
        call = control.wakeup(eng, m.TagArgs())
    await gen.step_lock.acquire()  # a step is in flight
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.05)
    assert eng.ranks.calls == [] and not task.done()  # nothing reached the ranks
    gen.step_lock.release()
    await asyncio.wait_for(task, 5)
    assert eng.ranks.calls and eng.ranks.calls[0][0] in {"stage", "sleep", "wakeup"}


async def test_stall_names_a_loop_without_progress_and_only_then() -> None:
    gen = engine().scheduler
    assert gen.stall() is None  # idle
    gen.active, gen.in_step = True, 7
    gen.last_progress = time.monotonic()
    assert gen.stall() is None  # busy, but progressing
    gen.last_progress = time.monotonic() - 6.0
    why = gen.stall()
    assert why and "no progress for 6s" in why and "step 7" in why
    gen.active = False
    assert gen.stall() is None  # idle with nothing waiting
    gen.sched.add(m.GenRequest("r1", [1, 2, 3], 5), "reply.r1")
    why = gen.stall()  # idle while a request waits and the gates are open
    assert why and "idle for 6s while 1 requests wait" in why
    gen.run = False
    assert gen.stall() is None  # paused: waiting is what it should do


def test_a_rank_refuses_the_step_after_a_gap() -> None:
    st = Stepper(None, None, None, 1, Watermark())  # type: ignore[arg-type]
    assert st.gap(5) == ""  # first step seen: nothing to compare with
    assert st.gap(6) == ""
    assert st.gap(8) == (
        "rank 1: missed step 7 (got step 8): a step only some ranks received; not run"
    )
    assert "missed steps 9..11" in st.gap(12)
    assert st.gap(13) == ""
    assert st.gap(1) == ""  # a restarted engine counts from 1 again
    assert st.gap(2) == ""


class RecordingBus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, m.GenChunk]] = []

    async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
        self.sent.append((subject, m.unpack(data, type=m.GenChunk)))


async def test_a_wedged_step_loop_is_restarted_and_its_requests_get_503() -> None:
    """No heartbeat forever: a loop stuck past STALL_S + CONTROL_TIMEOUT_S is restarted
    by the heartbeat task; the request in flight ends with 503."""
    from shared.tasks import Supervisor

    eng = engine()
    eng.settings.stall_s = eng.settings.control_timeout_s = 0.1
    eng.bus = RecordingBus()
    gen = eng.scheduler
    steps = 0

    async def wedged(plan: Any, keep: bool) -> Any:
        nonlocal steps
        steps += 1
        if steps == 1:
            await asyncio.Event().wait()  # e.g. a bus call without a timeout
        raise AssertionError("the request should have been failed")

    gen._send_step = wedged  # type: ignore[method-assign]
    sup = Supervisor("engine", backoff=0.01)
    gen.background(sup)
    gen.sched.add(m.GenRequest("r1", [1, 2, 3], 5), "reply.r1")
    gen.work.set()
    try:
        for _ in range(300):
            if any(c.error_code for _, c in eng.bus.sent):
                break
            await asyncio.sleep(0.01)
    finally:
        await sup.stop()
    errors = [c for _, c in eng.bus.sent if c.error_code]
    assert errors and errors[0].error_code == 503 and errors[0].request_id == "r1"
    assert "step loop" in errors[0].error_message and "stalled" in errors[0].error_message
    assert sup.failures["step_loop"] == 1 and not gen.sched.requests


class PeerPings:
    """Stands in for the bus of a rank: every rank's ping reply, or silence."""

    def __init__(self, busy: dict[int, str | None]) -> None:
        self.busy = busy  # rank -> busy job; None = does not answer

    async def scatter(self, subject: str, data: bytes, **_: Any) -> dict[int, Any]:
        from shared.errors import Timeout

        reps = {
            r: SimpleNamespace(data=m.json_encode(m.WorkerReply(r, result={"busy": b})))
            for r, b in self.busy.items()
            if b is not None
        }
        missing = [r for r, b in self.busy.items() if b is None]
        if missing:
            raise Timeout(subject, 1.0, missing)
        return reps


async def test_after_a_gap_a_rank_runs_nothing_while_a_peer_is_in_a_step_it_missed() -> None:
    bus = PeerPings({0: "step 7", 1: ""})
    st = Stepper(None, bus, None, 1, Watermark(), peers=("ping", 2))  # type: ignore[arg-type]
    assert await st.blocked_peer() == ""  # no gap seen: no ping at all
    st.gap(6)
    assert st.gap(8)  # step 7 missed here; rank 0 is inside it
    st.gap(9)
    assert await st.blocked_peer() == "rank 0 is in step 7, which rank 1 never got"
    bus.busy[0] = None  # stopped: it may still hold step 7
    assert "ranks [0] do not answer" in await st.blocked_peer()
    bus.busy[0] = "step 9"  # rank 0 left step 7 (failed or done): aligned again
    assert await st.blocked_peer() == ""
    assert st.missed == []
    bus.busy[0] = "step 7"
    assert await st.blocked_peer() == ""  # forgotten: no more pings needed


async def test_the_queued_acknowledgement_names_the_serving_version() -> None:
    """The first heartbeat carries the weight version: an API that has not seen a token yet
    (just restarted) can still name the version of an answer that ends with no token."""
    sent: list[m.GenChunk] = []

    async def publish(subject: str, data: bytes, headers: Any = None) -> None:
        sent.append(m.unpack(data, type=m.GenChunk))

    eng = engine()
    eng.bus = SimpleNamespace(publish=publish)
    eng.settings.max_n, eng.settings.max_waiting = 8, 8
    gen = m.GenRequest("r1", [1, 2, 3], max_tokens=4)
    await eng.scheduler.on_gen(SimpleNamespace(reply="_INBOX.x.1", data=m.pack(gen), headers={}))
    assert [(c.heartbeat, c.version) for c in sent] == [(True, "v0")]


class PeerPingsAndReplies(PeerPings):
    def __init__(self, busy: dict[int, str | None]) -> None:
        super().__init__(busy)
        self.replies: list[m.StepReply] = []
        self.pings = 0

    async def scatter(self, subject: str, data: bytes, **kw: Any) -> dict[int, Any]:
        self.pings += 1
        return await super().scatter(subject, data, **kw)

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.replies.append(m.unpack(data, type=m.StepReply))


async def test_a_step_after_a_gap_is_not_run_while_a_peer_is_in_the_missed_step() -> None:
    # on_step itself (not only blocked_peer): pings only once a step was missed, and
    # refuses the in-sequence step that follows the gap while a peer is inside it
    from services.worker.stepcheck import StepLimits

    bus = PeerPingsAndReplies({0: "step 7", 1: ""})
    st = Stepper(None, bus, None, 1, Watermark(), peers=("ping", 2))  # type: ignore[arg-type]
    st.__dict__["limits"] = StepLimits(320, 16, 4, 64)  # (no KV cache here)

    def msg(step: int) -> Any:
        row = m.StepRow(0, [1], 0, [0], [])
        return SimpleNamespace(data=m.pack(m.StepRequest(step, [row])), reply="r", headers={})

    st.last_step = 6
    await st.on_step(msg(8))  # step 7 missed
    assert "missed step 7" in (bus.replies[-1].error or "") and bus.pings == 0
    await st.on_step(msg(9))
    assert bus.pings == 1
    assert bus.replies[-1].step == 9
    assert "not run: rank 0 is in step 7" in (bus.replies[-1].error or "")
