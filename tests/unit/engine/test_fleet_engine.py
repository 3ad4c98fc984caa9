"""An engine's side of a fleet transaction (services/engine/fleet.py) with scripted ranks
and an in-memory record bucket that compare-and-sets like the KV one: the steps, the
record checks, and the watchdog that follows the record when the coordinator is silent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from services.engine import fleet as ef
from services.engine.state import EngineState, State
from shared import fleet as f
from shared import messages as m
from shared.errors import ControlError

CT = 0.3


class Ranks:
    def __init__(self, version: str = "v0") -> None:
        self.version = version
        self.staged = ""
        self.calls: list[str] = []

    async def call(self, method: str, args: msgspec.Struct | None = None, **_: Any) -> Any:
        self.calls.append(method)
        if method == "stage":
            assert isinstance(args, m.StageArgs)
            self.staged = args.version
        elif method == "commit":
            self.version, self.previous = self.staged, self.version
        elif method == "rollback" and "commit" in self.calls:
            self.version = self.previous
        return {0: m.WorkerReply(0, result={"rank": 0, "version": self.version})}

    async def broadcast(self, method: str, args: msgspec.Struct | None = None) -> None:
        self.calls.append(method)


class Bucket:
    """FleetBucket's contract in memory: decide() only when shared.fleet.allowed()."""

    def __init__(self) -> None:
        self.recs: dict[str, f.Record] = {}

    async def get(self, txn: str) -> tuple[f.Record, int] | None:
        r = self.recs.get(txn)
        return (msgspec.structs.replace(r), 1) if r else None

    async def decide(
        self, txn: str, to: str, actor: str, reason: str, check: Any = None
    ) -> f.Record | None:
        r = self.recs.get(txn)
        if r is None:
            return None
        if check is not None:
            check(msgspec.structs.replace(r))
        if r.decision != to and f.allowed(r.decision, to, actor):
            r.decision, r.reason = to, reason  # type: ignore[assignment]
        return msgspec.structs.replace(r)


def engine(ranks: Ranks) -> Any:
    step = asyncio.Lock()
    events: list[tuple[str, dict[str, Any]]] = []

    @contextlib.asynccontextmanager
    async def quiet() -> AsyncIterator[None]:
        async with step:
            yield

    async def pause(mode: str) -> int:
        return 0

    sched = SimpleNamespace(
        quiet=quiet, pause=pause, resume=lambda: None, weights_changed=lambda v: None,
        drop_kv=lambda: None,
    )

    async def state_changed(to: str, data: dict[str, Any]) -> None:
        events.append((to, data))

    async def event(kind: str, data: dict[str, Any]) -> None:
        events.append((kind, data))

    eng = SimpleNamespace(
        state=EngineState(weight_version="v0"), ranks=ranks, scheduler=sched,
        lock=asyncio.Lock(), state_changed=state_changed, event=event, events=events,
        bus=SimpleNamespace(nc=None),
        settings=SimpleNamespace(control_timeout_s=CT, load_strategy="snapshot", instance="i"),
    )
    eng.fleet = ef.Fleet(eng)  # type: ignore[arg-type]
    eng.fleet.bucket = Bucket()
    return eng


async def _staged(eng: Any, txn: str = "t1", version: str = "v1") -> None:
    eng.fleet.bucket.recs[txn] = f.Record(txn, version, ["i"], "staged")
    res = await ef.fleet_stage(eng, f.StageTxnArgs(txn, version))
    assert res["previous_version"] == "v0"
    assert eng.state.state is State.UPDATING and eng.fleet.txn.phase == "staged"
    # the update in progress is persisted with the transaction and "resume"
    upd = next(d for k, d in eng.events if k == "updating")
    assert upd["fleet_txn"] == txn and upd["resume"] is True


async def test_silent_coordinator_before_commit_aborts_and_resumes() -> None:
    eng = engine(Ranks())
    await _staged(eng)
    await asyncio.sleep(CT + 0.3)
    rec = eng.fleet.bucket.recs["t1"]
    assert rec.decision == "abort" and rec.reason == "instance i"
    assert eng.fleet.txn is None and eng.state.state is State.RUNNING
    assert eng.state.weight_version == "v0" and "commit" not in eng.ranks.calls
    # a late coordinator can no longer commit
    late = await eng.fleet.bucket.decide("t1", "commit", "coordinator", "late")
    assert late.decision == "abort"


async def test_silent_coordinator_after_the_commit_decision_commits_itself() -> None:
    eng = engine(Ranks())
    await _staged(eng)
    eng.fleet.bucket.recs["t1"].decision = "commit"  # the coordinator decided, then died
    await asyncio.sleep(CT + 0.3)
    assert eng.fleet.bucket.recs["t1"].decision == "done"
    assert eng.ranks.calls[-2:] == ["commit", "finalize"]
    assert eng.state.weight_version == "v1" and eng.state.state is State.RUNNING


async def test_commit_needs_the_written_decision() -> None:
    eng = engine(Ranks())
    await _staged(eng)
    with pytest.raises(ControlError) as e:
        await ef.fleet_commit(eng, f.TxnArgs("t1"))
    assert e.value.code == 409 and "'staged'" in e.value.message
    assert "commit" not in eng.ranks.calls
    with pytest.raises(ControlError):
        await ef.fleet_commit(eng, f.TxnArgs("other"))
    eng.fleet.clear(eng.fleet.txn)


async def test_committed_then_aborted_swaps_back() -> None:
    eng = engine(Ranks())
    await _staged(eng)
    eng.fleet.bucket.recs["t1"].decision = "commit"
    await ef.fleet_commit(eng, f.TxnArgs("t1"))
    assert eng.ranks.version == "v1" and eng.state.state is State.UPDATING
    assert eng.state.weight_version == "v0"  # not serving it before the decision is done
    # an instance may not abort a commit decision; the coordinator may (a commit failed)
    with pytest.raises(ControlError):
        await ef.fleet_abort(eng, f.TxnArgs("t1"))
    eng.fleet.bucket.recs["t1"].decision = "abort"
    res = await ef.fleet_abort(eng, f.TxnArgs("t1"))
    assert res["aborted"]
    assert eng.ranks.version == "v0" and eng.state.weight_version == "v0"
    assert eng.state.state is State.RUNNING and eng.fleet.txn is None


async def test_finalize_only_once_done_and_a_second_transaction_waits() -> None:
    eng = engine(Ranks())
    await _staged(eng)
    with pytest.raises(ControlError) as e:
        await ef.fleet_stage(eng, f.StageTxnArgs("t2", "v2"))
    assert e.value.code == 409
    eng.fleet.bucket.recs["t1"].decision = "commit"
    await ef.fleet_commit(eng, f.TxnArgs("t1"))
    res = await ef.fleet_finalize(eng, f.TxnArgs("t1"))
    assert res["finalized"] and res["weight_version"] == "v1"
    assert eng.fleet.bucket.recs["t1"].decision == "done"
    assert eng.state.state is State.RUNNING
    # a repeated finalize (or one after the watchdog) is a no-op
    assert (await ef.fleet_finalize(eng, f.TxnArgs("t1")))["finalized"] is False


async def test_an_instance_already_paused_stays_paused() -> None:
    eng = engine(Ranks())
    eng.state.pause("keep")
    eng.fleet.bucket.recs["t1"] = f.Record("t1", "v1", ["i"], "staged")
    await ef.fleet_stage(eng, f.StageTxnArgs("t1", "v1"))
    eng.fleet.bucket.recs["t1"].decision = "abort"
    await ef.fleet_abort(eng, f.TxnArgs("t1"))
    assert eng.state.state is State.PAUSED
