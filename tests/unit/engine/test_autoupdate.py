"""The auto-update "newer" decision: by first-publish stream sequence, never back."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

from services.engine.autoupdate import PERMANENT, VersionIndex, apply, index_of, newest
from services.engine.state import State
from shared.messages import VersionPublished


def _ev(v: str) -> VersionPublished:
    return VersionPublished(model="m", version=v, tp=2)


def _index() -> VersionIndex:
    idx = VersionIndex()
    for seq, v in [(1, "b1"), (2, "b2"), (3, "b3")]:
        idx.add(v, seq)
    return idx


def test_a_never_published_current_is_older_than_anything_published() -> None:
    idx = _index()
    assert idx.is_newer("b1", "v0") and idx.is_newer("b3", "v0")
    assert not idx.is_newer("v0", "v0")


def test_reannounced_old_or_current_version_never_moves_back() -> None:
    idx = _index()
    assert not idx.is_newer("b2", "b3")
    # past the dedup window the same version string comes again at a new sequence
    idx.add("b1", 10)
    idx.add("b3", 11)
    assert idx.seq_of("b1") == 1 and idx.seq_of("b3") == 3
    assert not idx.is_newer("b1", "b3") and not idx.is_newer("b3", "b3")
    assert idx.latest == "b3"  # the default of update_weights does not move back either
    idx.add("b4", 12)
    assert idx.is_newer("b4", "b3") and idx.latest == "b4"


def test_nothing_at_or_below_a_served_sequence_applies_again() -> None:
    idx = _index()
    assert not idx.is_newer("b3", "b3")  # serving b3 (seq 3) ...
    # ... then an operator rolls back to b1: a re-announced b2 is still not newer
    assert not idx.is_newer("b2", "b1")
    idx.add("b5", 20)
    assert idx.is_newer("b5", "b1")


def test_learned_out_of_order_keeps_the_first_sequence() -> None:
    idx = VersionIndex()
    idx.add("b1", 10)  # the re-announcement seen first
    idx.add("b2", 5)
    assert idx.latest == "b1"
    idx.add("b1", 1)  # its first announcement
    assert idx.seq_of("b1") == 1 and idx.latest == "b2"
    assert not idx.is_newer("b1", "b2")


def test_newest_of_a_burst_by_first_sequence() -> None:
    idx = _index()
    idx.add("b1", 10)
    burst = [(3, _ev("b3")), (10, _ev("b1"))]
    assert newest(burst, idx) == burst[0]
    assert newest([], idx) is None


def test_only_bad_versions_are_permanent_failures() -> None:
    assert PERMANENT == {400, 422}  # 404 (not there yet) / 409 / 5xx / timeouts are retried


# --------------------------------------------------------------------------- apply()


class FakeEngine:
    """What autoupdate.apply touches, with scripted ranks (tests/unit/engine)."""

    def __init__(self, current: str, fail: dict[str, tuple[int, str]] | None = None) -> None:
        from services.engine.state import EngineState
        from tests.unit.engine.test_update_flow import ScriptedRanks

        self.state = EngineState(weight_version=current)
        self.lock = asyncio.Lock()
        self.ranks = ScriptedRanks(fail)
        self.latest_published = ""
        self.settings = SimpleNamespace(
            auto_update_pause_mode="keep",
            auto_update_verify_checksum=False,
            load_strategy="snapshot",
            model_dir="/nonexistent",
        )
        self.events: list[dict[str, Any]] = []

        async def pause(mode: str) -> int:
            return 0

        self.scheduler = SimpleNamespace(
            pause=pause,
            resume=lambda: None,
            weights_changed=lambda v: None,
            quiet=contextlib.nullcontext,
        )

    async def event(self, kind: str, data: dict[str, Any], request_id: str = "") -> None:
        if kind == "auto_update":
            self.events.append(data)

    async def state_changed(self, to: str, data: dict[str, Any]) -> None:
        return None


def _known(eng: FakeEngine) -> None:
    idx = index_of(eng)
    for seq, v in [(1, "b1"), (2, "b2"), (3, "b3")]:
        idx.add(v, seq)


def test_newer_is_decided_under_the_control_lock() -> None:
    async def go() -> None:
        eng = FakeEngine("b1")
        _known(eng)
        await eng.lock.acquire()  # an operator's update_weights is running ...
        task = asyncio.create_task(apply(eng, 2, _ev("b2")))
        await asyncio.sleep(0.01)
        eng.state.weight_version = "b3"  # ... and commits b3 meanwhile
        eng.lock.release()
        rec = await task
        assert rec["action"] == "ignored", rec
        assert eng.state.weight_version == "b3" and not eng.ranks.calls

    asyncio.run(go())


def test_update_while_sleeping_stays_asleep_and_records_the_version() -> None:
    eng = FakeEngine("b1")
    _known(eng)
    eng.state.pause("abort")
    eng.state.sleep(("weight", "kv_cache"))
    rec = asyncio.run(apply(eng, 3, _ev("b3")))
    assert rec["action"] == "updated" and rec["asleep"] == ["kv_cache", "weight"]
    assert eng.state.weight_version == "b3" and eng.state.state is State.SLEEPING
    assert [c[0] for c in eng.ranks.calls] == ["stage", "commit"]


def test_transient_failures_are_retried_bad_versions_are_not() -> None:
    for code, retry in [(503, True), (409, True), (500, True), (422, False), (404, True)]:
        eng = FakeEngine("b1", fail={"stage": (code, "rank 1: no")})
        _known(eng)
        rec = asyncio.run(apply(eng, 2, _ev("b2")))
        assert rec["action"] == "failed" and rec["retry"] is retry, (code, rec)
        assert eng.state.weight_version == "b1" and eng.state.state is State.RUNNING


def test_a_version_failed_for_good_is_refused_and_names_the_next() -> None:
    """The ``auto_update`` event of a refusal says which version is tried instead:
    never one refused already (e.g. before a restart, restored from the stored state)."""
    eng = FakeEngine("b1", fail={"stage": (422, "rank 0: sharded for tp=4")})
    _known(eng)
    rec = asyncio.run(apply(eng, 3, _ev("b3")))
    assert rec["retry"] is False and rec["next"] == "b2", rec
    assert index_of(eng).refused == {"b3"} and eng.events[-1]["next"] == "b2"
    index_of(eng).restore_refused(["b2"])
    rec = asyncio.run(apply(eng, 3, _ev("b3")))
    assert rec["next"] is None, rec


def test_a_refused_version_announced_again_is_not_tried_again() -> None:
    """A version refused for good (here, or before a restart: the stored ``refused``)
    is never a target again: its event once more — redelivered to an engine that died
    before acking it, re-announced past the dedup window, published again — is ignored,
    without a pause (before: pause, the same 422, resume, each time)."""
    eng = FakeEngine("b1", fail={"stage": (422, "rank 0: sharded for tp=4")})
    _known(eng)
    index_of(eng).restore_refused(["b3"])  # refused before the restart
    rec = asyncio.run(apply(eng, 3, _ev("b3")))
    assert rec["action"] == "ignored" and "refused" in rec["reason"], rec
    assert rec["next"] == "b2", rec  # the newest other one is tried instead
    assert not eng.ranks.calls and eng.state.state is State.RUNNING


def test_a_refused_version_still_counts_toward_staleness() -> None:
    """The staleness bound counts published versions (issue: "more than k published
    versions behind the newest announced"): a version auto-update refused here (e.g.
    sharded for another tp) is still the trainer's newest, so an engine serving an older
    one is behind it; served after all (an operator's update), it is the serving one."""
    from services.engine.autoupdate import staleness_of

    class Engine:  # weakly referenced (index_of's key): a plain object
        state = SimpleNamespace(weight_version="v3")

    engine = Engine()
    idx = index_of(engine)  # type: ignore[arg-type]
    for seq, v in enumerate(("v1", "v2", "v3"), 1):
        idx.add(v, seq)
    idx.refuse("v3")
    assert staleness_of(engine)[0] == 0  # type: ignore[arg-type]
    engine.state.weight_version = "v2"  # the newest it can load: still one behind v3
    assert staleness_of(engine)[0] == 1  # type: ignore[arg-type]


# --------------------------------------------------------------------------- pending()


class Store:
    """The bucket as a direct get of an object's meta answers (a core NATS request)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.asked: list[str] = []

    async def request(self, subject: str, data: bytes, timeout: float) -> Any:
        import base64
        import json

        self.asked.append(subject)
        name = base64.urlsafe_b64decode(subject.rsplit(".", 1)[1]).decode()
        if name in self.names:
            meta = {"name": name, "nuid": "n", "size": 1, "chunks": 1}
            return SimpleNamespace(data=json.dumps(meta).encode(), headers={})
        return SimpleNamespace(data=b"", headers={"Status": "404"})


def _engine(store: Any, model_dir: Any, tmp_path: Any, strategy: str, tp: int) -> Any:
    """What :func:`pending` and :func:`_meanwhile` read of an engine: its bus and settings
    (model ``m``, bucket ``b``, ipc dir under ``tmp_path``)."""
    return SimpleNamespace(
        bus=SimpleNamespace(nc=store),
        settings=SimpleNamespace(
            served_model_name="m",
            model_dir=model_dir,
            load_strategy=strategy,
            ipc_dir=tmp_path / "shm",
            tp=tp,
            ckpt_bucket="b",
        ),
    )


def test_pending_looks_where_a_rank_would_and_any_place_will_do(tmp_path: Any) -> None:
    """Not there yet = in none of the places the strategy's ranks look (ipc dir, a
    complete ``versions/V``, the object store's manifest); there in any = go."""
    from services.engine.autoupdate import pending
    from services.tiny_model import TINY_CONFIG, create_model_dir
    from services.trainer.shards import write_sharded_dir
    from shared import sharding
    from shared.model_config import ModelConfig

    model_dir = create_model_dir(tmp_path / "m", TINY_CONFIG, seed=0)
    store = Store()
    eng = _engine(store, model_dir, tmp_path, "ipc", tp=2)
    look = lambda v: asyncio.run(pending(eng, v))  # type: ignore[arg-type]  # noqa: E731
    assert look("v0") is None  # the model dir's own version: always there
    why = look("s1")
    assert why == (
        "no ipc dir with a manifest.json; no versions/s1; no m/s1/manifest.json in bucket b"
    ), why
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    d = model_dir / "versions" / "s1"
    man = write_sharded_dir(d, cfg, sharding.init_weights(cfg, 1), 2, "m", "s1")
    assert look("s1") is None
    f = d / man.shards[1].file
    f.write_bytes(f.read_bytes()[:100])  # being copied: rank 1's shard is short
    assert "versions/s1: rank1-of-2.safetensors has 100 of" in str(look("s1"))
    store.names.add("m/s1/manifest.json")  # the object store has it: a rank falls back there
    assert look("s1") is None
    ipc = tmp_path / "shm" / "m" / "s2"
    ipc.mkdir(parents=True)
    assert look("s2") is not None  # an ipc dir without its manifest is not there yet
    (ipc / "manifest.json").write_text("{}")
    asked = len(store.asked)
    assert look("s2") is None and len(store.asked) == asked  # found first: no NATS look


class Silent(Store):
    """A bucket whose direct get gets no answer (a server too slow, a lost reply)."""

    async def request(self, subject: str, data: bytes, timeout: float) -> Any:
        self.asked.append(subject)
        raise TimeoutError


def test_meanwhile_serves_only_a_version_known_to_be_there(tmp_path: Any) -> None:
    """While the newest version's files are awaited, an older one is served meanwhile
    only if its files are known to be there: a look that cannot answer is not a go
    (before: a pause and a failed update of a version nobody awaits, per such look).
    The awaited version's own look still goes ahead then (the update decides)."""
    from services.engine.autoupdate import _meanwhile, index_of, pending
    from services.tiny_model import TINY_CONFIG, create_model_dir

    model_dir = create_model_dir(tmp_path / "m", TINY_CONFIG, seed=0)
    store = Store()
    eng = _engine(store, model_dir, tmp_path, "object_store", tp=1)
    eng.state = SimpleNamespace(weight_version="v1")
    idx = index_of(eng)  # type: ignore[arg-type]
    for seq, v in enumerate(("v1", "v2", "v3"), 1):
        idx.add(v, seq)
    meanwhile = lambda: asyncio.run(_meanwhile(eng, "v3", set(), {"v2"}))  # type: ignore[arg-type]  # noqa: E731
    assert meanwhile() is None  # v2's files: not there
    store.names.add("m/v2/manifest.json")
    assert meanwhile() == "v2"
    eng.bus.nc = Silent()
    assert meanwhile() is None and eng.bus.nc.asked  # looked, no answer: not a go
    assert asyncio.run(pending(eng, "v3")) is None  # type: ignore[arg-type]
