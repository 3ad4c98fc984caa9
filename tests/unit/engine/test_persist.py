"""The engine's state record: encoding, restore, and bringing ranks to it (scripted ranks)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from services.engine import persist
from services.engine.ranks import RankError
from services.engine.state import EngineState, State
from shared import messages as m
from shared.statekv import key_for


class Ranks:
    """Scripted ranks: each reports ``versions[r]`` and the ``loaded`` flags."""

    def __init__(self, versions: list[str], loaded: bool = True) -> None:
        self.versions, self.loaded = versions, loaded
        self.calls: list[tuple[str, Any]] = []
        self.broadcasts: list[tuple[str, Any]] = []
        self.staged = ""

    async def call(self, method: str, args: msgspec.Struct | None = None, **_: Any) -> Any:
        self.calls.append((method, args))
        if method == "stage":
            assert isinstance(args, m.StageArgs)
            self.staged = args.version
        if method == "commit":
            self.versions = [self.staged] * len(self.versions)
        if method == "wakeup":
            self.loaded = True
        res = {
            r: {"rank": r, "version": v, "pid": 100 + r, "rolled_back": False}
            for r, v in enumerate(self.versions)
        }
        return {r: m.WorkerReply(r, result=x) for r, x in res.items()}

    async def broadcast(self, method: str, args: msgspec.Struct | None = None) -> None:
        self.broadcasts.append((method, args))

    async def statuses(self, timeout: float = 1.0) -> list[dict[str, Any]]:
        flags = {"weights_loaded": self.loaded, "kv_allocated": self.loaded, "comm_group": True}
        return [
            {"rank": r, "alive": True, "version": v, **flags} for r, v in enumerate(self.versions)
        ]


def engine(ranks: Ranks, **state: Any) -> Any:
    lock = asyncio.Lock()
    sched = SimpleNamespace(admit=True, run=True, dropped=0, step_lock=lock)

    def drop_kv() -> None:
        assert lock.locked()
        sched.dropped += 1

    @contextlib.asynccontextmanager
    async def quiet() -> AsyncIterator[None]:
        async with lock:
            yield

    sched.drop_kv = drop_kv
    sched.quiet = quiet
    return SimpleNamespace(
        state=EngineState(**state),
        ranks=ranks,
        scheduler=sched,
        rank_pids={},
        settings=SimpleNamespace(
            load_strategy="snapshot",
            control_timeout_s=5.0,
            shutdown_comm_group_if_worker_idle=False,
        ),
    )


def test_record_round_trip_and_bad_records() -> None:
    rec = persist.Record("updating", "v1", ["kv_cache"], "keep", persist.Update("u", "v2", "v1"))
    assert persist.decode(persist.encode(rec)) == rec
    for bad in (b"{", b'{"state": "dancing", "weight_version": "v1"}', b"[]"):
        with pytest.raises(ValueError, match="unreadable engine state"):
            persist.decode(bad)


def test_snapshot_keeps_the_update_only_while_updating() -> None:
    eng = engine(Ranks(["v1"]), weight_version="v1")
    upd = persist.Update("u", "v2", "v1")
    assert persist.snapshot(eng, upd).update is None  # running
    eng.state.state = State.UPDATING
    rec = persist.snapshot(eng, upd)
    assert rec.state == "updating" and rec.update == upd and rec.weight_version == "v1"


def test_apply_an_interrupted_update_comes_back_paused_on_the_previous_version() -> None:
    eng = engine(Ranks(["v0"]))
    upd = persist.Update("u", "v2", "v1")
    got = persist.apply(eng, persist.Record("updating", "v1", update=upd))
    assert got == upd
    assert eng.state.state is State.PAUSED and eng.state.weight_version == "v1"
    assert not eng.scheduler.admit and not eng.scheduler.run


def test_apply_sleeping_closes_the_gates() -> None:
    eng = engine(Ranks(["v0"]))
    assert persist.apply(eng, persist.Record("sleeping", "v3", ["kv_cache", "weight"])) is None
    assert eng.state.state is State.SLEEPING and eng.state.asleep == {"kv_cache", "weight"}
    assert not eng.scheduler.run and not eng.scheduler.admit


def test_reconcile_rolls_back_by_id_then_brings_restarted_ranks_to_the_version() -> None:
    ranks = Ranks(["v0", "v0"])  # restarted: the model dir's version
    eng = engine(ranks, state=State.PAUSED, weight_version="v1")
    done = asyncio.run(persist.reconcile(eng, persist.Update("u1", "v2", "v1")))
    methods = [c[0] for c in ranks.calls]
    # late calls a rank holds run before its state is looked at (drain)
    assert methods[:3] == ["rollback", "drain", "stage"] and "commit" in methods
    assert ranks.calls[0][1] == m.UpdateIdArgs("u1")
    assert ranks.versions == ["v1", "v1"] and done["from"] == {0: "v0", 1: "v0"}
    assert [b[0] for b in ranks.broadcasts] == ["finalize"]
    assert eng.rank_pids == {0: 100, 1: 101} and eng.scheduler.dropped == 1


def test_reconcile_reapplies_sleep_and_wakes_ranks_for_an_awake_engine() -> None:
    ranks = Ranks(["v1", "v1"])
    eng = engine(ranks, state=State.SLEEPING, weight_version="v1", asleep={"kv_cache"})
    asyncio.run(persist.reconcile(eng))
    assert [c[0] for c in ranks.calls if c[0] != "ping"] == ["drain", "sleep"]
    assert ranks.calls[1][1] == m.SleepWorkerArgs(["kv_cache"], False)
    asleep = Ranks(["v1", "v1"], loaded=False)
    eng = engine(asleep, weight_version="v1")  # running, but the ranks are asleep
    asyncio.run(persist.reconcile(eng))
    assert [c[0] for c in asleep.calls if c[0] != "ping"] == ["drain", "wakeup"]


class SilentOnDrain(Ranks):
    """Rank 1 answers ``status`` but not ``drain`` (its compute thread is stuck)."""

    def __init__(self, versions: list[str]) -> None:
        super().__init__(versions)
        self.unsettled, self.unsettled_n = "", 0
        self.timeouts: dict[str, float | None] = {}

    async def call(self, method: str, args: msgspec.Struct | None = None, **kw: Any) -> Any:
        self.timeouts[method] = kw.get("timeout")
        if method == "drain":
            self.calls.append((method, args))
            raise RankError(503, f"drain: ranks [1] did not answer within {kw['timeout']:g}s", {})
        return await super().call(method, args, **kw)


def test_reconcile_gives_up_on_a_rank_that_does_not_drain_and_leaves_it_unsettled() -> None:
    """The drain waits ``DRAIN_S``, not CONTROL_TIMEOUT_S (the control lock is held
    meanwhile); giving up changes nothing and marks the ranks unsettled, so the watcher
    tries again once every rank answers."""
    ranks = SilentOnDrain(["v0", "v1"])
    eng = engine(ranks, weight_version="v1")
    eng.settings.control_timeout_s = 60.0
    with pytest.raises(RankError, match=r"drain: ranks \[1\] did not answer within 2s"):
        asyncio.run(persist.reconcile(eng))
    assert ranks.timeouts["drain"] == persist.DRAIN_S < eng.settings.control_timeout_s
    assert [c[0] for c in ranks.calls] == ["drain"]  # nothing looked at, nothing changed
    assert ranks.unsettled == "reconcile: drain: ranks [1] did not answer within 2s"
    assert ranks.unsettled_n == 1
    eng.settings.control_timeout_s = 1.0  # a shorter control timeout bounds it too
    with pytest.raises(RankError):
        asyncio.run(persist.reconcile(eng))
    assert ranks.timeouts["drain"] == 1.0 and ranks.unsettled_n == 2


def test_the_drain_bound_covers_the_steps_queued_on_a_slow_model() -> None:
    """Steps of 1.5 s (a big model, a loaded host): a drain behind the ones already sent
    needs more than 2 s; the bound follows the engine's recent step time, capped by
    CONTROL_TIMEOUT_S."""
    eng = engine(Ranks(["v1"]), weight_version="v1")
    eng.settings.control_timeout_s = 60.0
    assert persist.drain_bound(eng) == persist.DRAIN_S  # no step yet
    eng.scheduler.step_avg = 0.05
    assert persist.drain_bound(eng) == persist.DRAIN_S
    eng.scheduler.step_avg = 1.5
    assert persist.drain_bound(eng) == 1.5 * persist.DRAIN_STEPS
    ranks = SilentOnDrain(["v1", "v1"])  # what reconcile waits
    eng.ranks = ranks
    with pytest.raises(RankError):
        asyncio.run(persist.reconcile(eng))
    assert ranks.timeouts["drain"] == 1.5 * persist.DRAIN_STEPS
    eng.scheduler.step_avg = 100.0
    assert persist.drain_bound(eng) == 60.0


def test_busy_rank_names_a_compute_thread_stuck_past_the_drain_bound() -> None:
    def rep(r: int, busy: str, busy_s: float) -> m.WorkerReply:
        return m.WorkerReply(r, result={"busy": busy, "busy_s": busy_s})

    free = {0: rep(0, "", 0.0), 1: rep(1, "step 7", 0.05)}
    assert persist.busy_rank(free) == ""
    stuck = {0: rep(0, "wakeup", persist.DRAIN_S + 10.0), 1: rep(1, "", 0.0)}
    assert persist.busy_rank(stuck) == "rank 0's compute thread has run wakeup for 12.0 s"
    assert persist.busy_rank({0: m.WorkerReply(0, result={})}) == ""  # an older rank


def test_ranks_changed() -> None:
    eng = engine(Ranks(["v1"]), weight_version="v1")
    reps = {0: m.WorkerReply(0, result={"version": "v1", "pid": 5})}
    assert persist.ranks_changed(eng, reps) == ""  # nothing known yet, same version
    eng.rank_pids = {0: 5}
    assert persist.ranks_changed(eng, reps) == ""
    eng.rank_pids = {0: 4}
    assert persist.ranks_changed(eng, reps) == "restarted"
    eng.rank_pids = {0: 5}
    eng.state.weight_version = "v2"
    assert persist.ranks_changed(eng, reps) == "version"


def test_key_for_escapes_what_kv_keys_cannot_hold() -> None:
    assert key_for("default") == "default"
    assert key_for("a.b c/é") == "a=2Eb=20c=2F=C3=A9"
    assert key_for("x=1") == "x=3D1"  # '=' is the escape: escaped itself


class Bucket:
    def __init__(self) -> None:
        self.puts: list[persist.Record] = []
        self.fail = False

    async def put(self, data: bytes) -> None:
        if self.fail:
            raise ConnectionError("nats down")
        self.puts.append(persist.decode(data))


def test_persister_writes_versions_at_once_other_changes_in_the_background() -> None:
    async def go() -> None:
        eng = engine(Ranks(["v1"]), weight_version="v1")
        eng.bus = SimpleNamespace(nc=None)
        eng.settings.instance = "i"
        p = persist.Persister(eng)
        p.bucket = bucket = Bucket()  # type: ignore[assignment]
        await p.save()  # first record: written at once
        assert [r.state for r in bucket.puts] == ["running"]
        await p.save()  # unchanged: nothing written
        eng.state.pause("keep")
        await p.save()  # a state change: left to the writer
        assert len(bucket.puts) == 1
        writer = asyncio.create_task(p.run())
        await asyncio.sleep(0.3)
        assert [r.state for r in bucket.puts] == ["running", "paused"]
        eng.state.resume()
        await p.save()
        eng.state.pause("keep")
        await p.save()
        await asyncio.sleep(0.3)  # resumed and paused again: nothing new to write
        assert len(bucket.puts) == 2
        eng.state.begin_update()
        p.state_changed("updating", {"update_id": "u", "version": "v2", "from": "v1"})
        await p.save()  # the update in progress: written before save returns
        assert bucket.puts[-1].update == persist.Update("u", "v2", "v1")
        bucket.fail = True
        eng.state.end_update("v2")
        p.state_changed("paused", {"version": "v2"})
        await p.save()  # fails: retried by the writer until it lands
        bucket.fail = False
        await asyncio.sleep(1.2)
        assert bucket.puts[-1].weight_version == "v2" and bucket.puts[-1].update is None
        writer.cancel()

    asyncio.run(go())


def test_refused_versions_are_stored_and_restored() -> None:
    """Versions auto-update refused for good are part of the stored state: an engine
    restored from it does not try them again (before, they were forgotten). Those at
    or below the served sequence can never be a target again and are dropped."""
    from services.engine.autoupdate import index_of

    old = b'{"state": "running", "weight_version": "v1"}'  # written before the field
    assert persist.decode(old).refused == []
    eng = engine(Ranks(["v1"]), weight_version="v1")
    idx = index_of(eng)  # type: ignore[arg-type]
    for seq, v in enumerate(("v1", "bad1", "v2", "bad2"), 1):
        idx.add(v, seq)
    idx.refuse("bad1")
    idx.refuse("bad2")
    idx.refuse("unseen")  # refused before its event was learned: kept
    rec = persist.decode(persist.encode(persist.snapshot(eng)))
    assert rec.refused == ["unseen", "bad1", "bad2"]
    idx.served("v2")
    assert persist.snapshot(eng).refused == ["unseen", "bad2"]
    back = engine(Ranks(["v1"]), weight_version="v1")
    persist.apply(back, rec)
    assert index_of(back).refused == {"unseen", "bad1", "bad2"}  # type: ignore[arg-type]
    assert index_of(back).fallback("v1") is None  # type: ignore[arg-type]


def test_the_highest_version_served_is_stored_and_a_restored_engine_never_moves_back() -> None:
    """An operator rolled back from v3 to v1: the stored state names v3, so the restored
    engine takes neither v3 nor v2 (at or below it) as newer — its events learned after
    the restore —, a later v4 it does. Before, only the in-memory index knew it."""
    from services.engine.autoupdate import index_of

    assert persist.decode(b'{"state": "running", "weight_version": "v1"}').high is None
    eng = engine(Ranks(["v1"]), weight_version="v1")
    # none served yet (the model dir's version): named as such, not as an older record
    assert persist.decode(persist.encode(persist.snapshot(eng))).high == ""
    idx = index_of(eng)  # type: ignore[arg-type]
    for seq, v in enumerate(("v1", "v2", "v3"), 1):
        idx.add(v, seq)
    idx.served("v3")  # served, then rolled back to v1 (the engine's version)
    rec = persist.decode(persist.encode(persist.snapshot(eng)))
    assert (rec.weight_version, rec.high) == ("v1", "v3")
    back = engine(Ranks(["v1"]), weight_version="v1")
    persist.apply(back, rec)
    bidx = index_of(back)  # type: ignore[arg-type]
    assert persist.snapshot(back).high == "v3"  # kept while its sequence is not known
    for seq, v in enumerate(("v1", "v2", "v3", "v4"), 1):
        bidx.add(v, seq)
    assert not bidx.is_newer("v3", "v1") and not bidx.is_newer("v2", "v1")
    assert bidx.is_newer("v4", "v1")
    assert persist.snapshot(back).high == "v3"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("refused", "bad1"),  # a string where a list goes: hand-edited
        ("refused", [1, {"x": 2}]),
        ("asleep", {"weight": True}),
        ("update", {"version": 3}),
        ("saved_at", "yesterday"),
    ],
)
def test_a_bad_optional_field_is_dropped_alone(
    field: str, value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """One corrupt or hand-edited field loses only itself: the rest of the state (the
    version, the pause) is restored, and one warning names the field. Before, the whole
    record was unreadable and the engine started from the ranks' state."""
    good = {"state": "paused", "weight_version": "v7", "pause_mode": "keep", "refused": ["b"]}
    rec = persist.decode(msgspec.json.encode({**good, field: value}))
    assert (rec.state, rec.weight_version, rec.pause_mode) == ("paused", "v7", "keep")
    assert rec.refused == ([] if field == "refused" else ["b"])
    said = [r.getMessage() for r in caplog.records if "field" in r.getMessage()]
    assert len(said) == 1 and repr(field) in said[0], said
    caplog.clear()
    for bad in ({"weight_version": "v7"}, {"state": "paused", "weight_version": 7}):
        with pytest.raises(ValueError, match="unreadable engine state"):  # still refused whole
            rest = {k: v for k, v in good.items() if k not in persist.REQUIRED}
            persist.decode(msgspec.json.encode({**rest, **bad, field: value}))
    # ... saying why, not that good fields were "ignored" (for the required one's reason)
    assert not [r for r in caplog.records if "field" in r.getMessage()], caplog.text
