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

    async def refresh(self, timeout: float | None = None) -> None:
        pass  # the engine's view of the ranks (services.engine.ranks.RankView)


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


def engine(ranks: Ranks, ct: float = CT) -> Any:
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

    async def event(kind: str, data: dict[str, Any], *_: Any) -> None:
        events.append((kind, data))

    eng = SimpleNamespace(
        state=EngineState(weight_version="v0"), ranks=ranks, scheduler=sched,
        lock=asyncio.Lock(), state_changed=state_changed, event=event, events=events,
        bus=SimpleNamespace(nc=None),
        settings=SimpleNamespace(control_timeout_s=ct, load_strategy="snapshot", instance="i"),
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


class SlowCommitRanks(Ranks):
    """Ranks whose commit takes a moment: the window in which the watchdog holds the
    control lock while the coordinator's fleet_commit arrives."""

    async def call(self, method: str, args: msgspec.Struct | None = None, **kw: Any) -> Any:
        if method == "commit":
            await asyncio.sleep(0.3)
        return await super().call(method, args, **kw)


def _dispatcher(eng: Any) -> Any:
    """The real Engine.dispatch (lock handling, replies) on the scripted engine."""
    from services.engine import main as em

    async def save() -> None:
        return None

    eng.persist = SimpleNamespace(save=save)
    eng._call = lambda fn, args, actor: em.Engine._call(eng, fn, args, actor)

    async def dispatch(method: str, args: dict[str, Any]) -> m.ControlReply:
        raw = await em.Engine.dispatch(eng, method, msgspec.json.encode(args), {})
        return msgspec.json.decode(raw, type=m.ControlReply)

    return dispatch


async def test_commit_waits_for_the_lock_its_own_watchdog_holds() -> None:
    """Review 11 #1: the watchdog commits the transaction itself (the record says
    ``commit``) under the control lock just as the coordinator's fleet_commit arrives:
    that commit waits for the lock and answers 200 (done, switched), not an instant 409.

    fleet_commit waits for the lock up to CONTROL_TIMEOUT_S. With CT (0.3 s, as long as
    the slow commit) that wait raced the watchdog's commit on a loaded machine; here the
    timeout is well over the time the watchdog holds the lock (the commit's 0.3 s)."""
    eng = engine(SlowCommitRanks(), ct=2.0)
    dispatch = _dispatcher(eng)
    await _staged(eng)
    eng.fleet.bucket.recs["t1"].decision = "commit"
    while not eng.lock.locked():  # the watchdog fired (CT) and commits under the lock
        await asyncio.sleep(0.01)
    rep = await dispatch("fleet_commit", {"txn": "t1"})
    assert rep.error_code == 200, rep.error_message
    assert rep.result["finalized"] is True and rep.result["weight_version"] == "v1"
    assert eng.fleet.bucket.recs["t1"].decision == "done"
    assert eng.state.state is State.RUNNING
    # a plain exclusive call still gets its instant 409 while the lock is held
    async with eng.lock:
        rep = await dispatch("pause", {"mode": "keep"})
    assert rep.error_code == 409


async def test_record_done_by_another_instance_still_commits() -> None:
    eng = engine(Ranks())
    await _staged(eng)
    eng.fleet.bucket.recs["t1"].decision = "done"  # another instance's watchdog finished it
    res = await ef.fleet_commit(eng, f.TxnArgs("t1"))
    assert res["committed"] == "v1" and eng.ranks.version == "v1"
    assert (await ef.fleet_finalize(eng, f.TxnArgs("t1")))["finalized"] is True


@pytest.mark.parametrize(
    "forged",
    [
        {"version": "v9"},  # not what it staged
        {"instances": ["other"]},  # not in the transaction
        {"txn": "t9"},  # another transaction's record under this key
    ],
)
async def test_a_foreign_record_commits_nothing(forged: dict[str, Any]) -> None:
    """Review 11 #4: a record written over raw NATS that does not name this instance's
    transaction (txn, version, instance) is a 409 on commit and finalize; the watchdog
    treats it as abort."""
    eng = engine(Ranks())
    await _staged(eng)
    recs = eng.fleet.bucket.recs
    recs["t1"] = msgspec.structs.replace(recs["t1"], decision="commit", **forged)
    with pytest.raises(ControlError) as e:
        await ef.fleet_commit(eng, f.TxnArgs("t1"))
    assert e.value.code == 409 and "not this transaction's" in e.value.message
    assert "commit" not in eng.ranks.calls
    recs["t1"].decision = "done"
    with pytest.raises(ControlError) as e:
        await ef.fleet_finalize(eng, f.TxnArgs("t1"))
    assert e.value.code == 409
    assert eng.state.state is State.UPDATING and eng.state.weight_version == "v0"
    await asyncio.sleep(CT + 0.3)  # the watchdog: a foreign record decides nothing
    assert eng.fleet.txn is None and eng.state.state is State.RUNNING
    assert eng.state.weight_version == "v0" and "commit" not in eng.ranks.calls


async def test_commit_of_a_restarted_instance_is_503() -> None:
    eng = engine(Ranks())
    eng.state.pause("keep")
    eng.state.begin_update()
    txn = ef.Txn("t1", "u1", "v1", "v0", True, "restored", 0.0)
    eng.fleet.touch(txn)
    eng.fleet.start(txn)
    eng.fleet.bucket.recs["t1"] = f.Record("t1", "v1", ["i"], "commit")
    with pytest.raises(ControlError) as e:
        await ef.fleet_commit(eng, f.TxnArgs("t1"))
    assert e.value.code == 503 and "restarted during the transaction" in e.value.message
    eng.fleet.clear(txn)


class DeadBucket(Bucket):
    async def decide(self, *a: Any, **kw: Any) -> f.Record | None:
        raise ConnectionError("bucket unreachable")


async def test_health_reports_a_transaction_waiting_on_its_record() -> None:
    """Review 11 #3: while the watchdog cannot read the record, /health is not green."""
    eng = engine(Ranks())
    await _staged(eng)
    assert eng.fleet.problem() == ""
    eng.fleet.bucket.__class__ = DeadBucket
    await asyncio.sleep(CT + 0.3)
    assert eng.fleet.txn is not None  # it never guesses
    assert "fleet transaction t1 undecided for" in eng.fleet.problem()
    eng.fleet.bucket.__class__ = Bucket
    await asyncio.sleep(1.3)
    assert eng.fleet.txn is None and eng.fleet.problem() == ""


def test_stage_refuses_a_txn_that_is_no_kv_key() -> None:
    for bad in ("bad*key>", "a.b", "", "x" * 65, "a b"):
        with pytest.raises(ControlError) as e:
            m.decode_args(msgspec.json.encode({"txn": bad, "version": "v1"}), f.StageTxnArgs)
        assert e.value.code == 400 and "'txn'" in e.value.message
        with pytest.raises(ControlError):
            m.decode_args(msgspec.json.encode({"txn": bad}), f.TxnArgs)
    assert m.decode_args(b'{"txn": "f0a-b_C", "version": "v1"}', f.StageTxnArgs).txn


async def _real_engine(nats_url: str) -> tuple[Any, Any]:
    import nats

    nc = await nats.connect(nats_url)
    await f.ensure_bucket(nc, 1)
    eng = engine(Ranks())
    eng.bus = SimpleNamespace(nc=nc)
    eng.fleet = ef.Fleet(eng)  # the real FleetBucket on a real JetStream KV
    return eng, nc


async def test_an_undecodable_record_is_an_abort(nats_url: str) -> None:
    """Review 11 #3: a record that does not decode is not "bucket unreachable for ever":
    the watchdog CAS-writes abort over it, drops the staged weights and resumes."""
    eng, nc = await _real_engine(nats_url)
    try:
        txn = f.new_txn_id()
        kv = await nc.jetstream().key_value(f.FLEET_BUCKET)
        await kv.put(txn, b'{"txn": "%s", "version": "v1", "instances": ["i"]}' % txn.encode())
        await ef.fleet_stage(eng, f.StageTxnArgs(txn, "v1"))
        await kv.put(txn, b'{"txn": "%s", "version": "v1", "instances": ["i"], '
                          b'"decision": "maybe"}' % txn.encode())
        for _ in range(50):
            if eng.fleet.txn is None:
                break
            await asyncio.sleep(0.1)
        assert eng.fleet.txn is None and eng.state.state is State.RUNNING
        assert eng.state.weight_version == "v0" and "rollback" in eng.ranks.calls
        rec = msgspec.json.decode((await kv.get(txn)).value, type=f.Record)
        assert rec.decision == "abort" and "does not decode" in rec.reason
    finally:
        await nc.close()


async def test_an_invalid_record_key_is_an_abort(nats_url: str) -> None:
    """A transaction id that cannot be a key (persisted before the check existed): the
    watchdog aborts instead of asking for ever."""
    eng, nc = await _real_engine(nats_url)
    try:
        eng.state.pause("keep")
        eng.state.begin_update()
        txn = ef.Txn("bad*key>", "u1", "v1", "v0", False, "restored", 0.0)  # deadline: now
        eng.fleet.start(txn)
        for _ in range(50):
            if eng.fleet.txn is None:
                break
            await asyncio.sleep(0.1)
        assert eng.fleet.txn is None and eng.state.state is not State.UPDATING
    finally:
        await nc.close()
