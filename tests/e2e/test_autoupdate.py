"""Auto-update against a real stack: never back, kept while asleep or failing, a
sleeping engine that accepts update_weights (a deleted version never forces a restart),
and an event whose files are not there yet (or still being copied) waited for without
a pause."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import msgspec
import pytest
from nats.js.errors import NotFoundError

from services.engine.autoupdate import durable_name
from services.trainer.publisher import CheckpointPublisher
from services.trainer.shards import write_sharded_dir
from shared import manifest as mf
from shared import objstore, sharding
from shared.messages import VersionPublished
from shared.model_config import ModelConfig
from shared.subjects import CKPT_STREAM, ckpt_published
from shared.versions import ipc_version_dir
from tests.e2e.stack import Stack, model_config, start_stack
from tests.e2e.test_checkpoints import (
    _raw,
    events,
    model_of,
    post,
    publish,
    training_state,
    wait_for,
)
from tests.e2e.test_control import digests

SHM = Path("/dev/shm/rollbus")


@pytest.fixture(scope="module")
def ustack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        Path(tmp_path_factory.mktemp("autoupd")),
        nats_url,
        tp=2,
        model_name=f"upd-{uuid.uuid4().hex[:6]}",
        env={
            "ROLLBUS_LOAD_STRATEGY": "ipc",
            "ROLLBUS_AUTO_UPDATE": "true",
            "ROLLBUS_CONTROL_TIMEOUT_S": "3",
        },
    )
    try:
        yield s
    finally:
        s.stop()
        shutil.rmtree(ipc_version_dir(SHM, model_of(s), "x").parent, ignore_errors=True)


@pytest.fixture(autouse=True)
def _awake_and_running(ustack: Stack) -> Iterator[None]:
    yield
    if ustack.status()["state"] == "sleeping":
        post(ustack, "/v1/wakeup")
    post(ustack, "/v1/resume")


def reannounce(stack: Stack, version: str) -> int:
    """The version's event again at a new stream sequence, as after the dedup window."""

    async def go(nc: Any) -> int:
        ev = VersionPublished(model_of(stack), version, 2)
        ack = await nc.jetstream().publish(
            ckpt_published(ev.model),
            msgspec.json.encode(ev),
            headers={objstore.MSG_ID: f"{ev.model}/{version}/{uuid.uuid4().hex}"},
        )
        return int(ack.seq)

    return int(asyncio.run(_raw(stack.nats_url, go)))


def auto_events(stack: Stack, version: str) -> list[dict[str, Any]]:
    return [e["data"] for e in events(stack, "auto_update") if e["data"]["version"] == version]


def serving(stack: Stack, version: str) -> bool:
    st = stack.status()
    return bool(st["weight_version"] == version and st["state"] == "running")


def announce_two_waited_for(stack: Stack, older: str, newest: str) -> None:
    """Announce ``older`` then ``newest``, neither with files; until the engine waits."""
    (stack.model_dir / "versions").mkdir(exist_ok=True)
    announce_only(stack, older)
    announce_only(stack, newest)
    wait_for(lambda: any(e["action"] == "waiting" for e in auto_events(stack, newest)))


def land_and_serve(stack: Stack, tmp: Path, version: str, seed: int) -> None:
    """``version``'s snapshot dir lands whole (written aside, renamed in); until served."""
    cfg = ModelConfig.from_hf(model_config(stack.model_dir))
    src = tmp / version
    write_sharded_dir(src, cfg, sharding.init_weights(cfg, seed), 2, model_of(stack), version)
    src.rename(stack.model_dir / "versions" / version)  # the copy of the version ends
    wait_for(lambda: serving(stack, version), 30)


def kill_engine_and_wait_for_the_next(stack: Stack) -> None:
    """SIGKILL the engine; return once the launcher's new engine serves (running, ranks
    ready)."""
    old = stack.status()["engine_pid"]
    os.kill(old, signal.SIGKILL)

    def new_engine_serving() -> bool:
        try:
            st = stack.status()
        except Exception:  # noqa: BLE001 - 503 while it restarts
            return False
        return st["engine_pid"] != old and st["ranks_ready"] and st["state"] == "running"

    wait_for(new_engine_serving, timeout=90)


def test_reannounced_old_and_current_versions_never_move_back(ustack: Stack) -> None:
    want = {v: publish(ustack, v, seed=50 + i, ipc=True) for i, v in enumerate(("r1", "r2"))}
    wait_for(lambda: serving(ustack, "r2"))
    assert digests(ustack) == want["r2"]
    seq_old, seq_cur = reannounce(ustack, "r1"), reannounce(ustack, "r2")
    for v, seq in (("r1", seq_old), ("r2", seq_cur)):
        wait_for(lambda v=v, seq=seq: any(e["seq"] == seq for e in auto_events(ustack, v)))
        rec = next(e for e in auto_events(ustack, v) if e["seq"] == seq)
        assert rec["action"] == "ignored", rec
    assert serving(ustack, "r2") and digests(ustack) == want["r2"]
    versions = [e["data"]["version"] for e in events(ustack, "version")]
    assert versions[-1] == "r2" and versions.count("r1") <= 1


def test_published_while_asleep_is_served_after_wakeup(ustack: Stack) -> None:
    assert post(ustack, "/v1/sleep").status_code == 200
    want = publish(ustack, "z1", seed=61, ipc=True)
    wait_for(lambda: any(e["action"] == "updated" for e in auto_events(ustack, "z1")))
    st = ustack.status()
    assert st["state"] == "sleeping" and st["weight_version"] == "z1"
    # recorded on every rank, nothing loaded while asleep
    assert all(r["version"] == "z1" and not r["weights_loaded"] for r in st["ranks"])
    r = post(ustack, "/v1/wakeup")
    assert r.status_code == 200, r.text
    assert serving(ustack, "z1") and digests(ustack) == want


def test_sleeping_engine_with_deleted_version_takes_an_update_and_wakes(ustack: Stack) -> None:
    earlier = publish(ustack, "d0", seed=70, ipc=True)
    publish(ustack, "d1", seed=71, ipc=True)
    wait_for(lambda: serving(ustack, "d1"))
    assert post(ustack, "/v1/sleep?tags=weight").status_code == 200
    shutil.rmtree(ipc_version_dir(SHM, model_of(ustack), "d1"))  # the current version: gone
    r = post(ustack, "/v1/wakeup?tags=weight")  # cannot load it; before, only a restart helped
    assert r.status_code == 404 and "update_weights to another version" in r.text, r.text
    assert ustack.status()["state"] == "sleeping"
    r = post(ustack, "/v1/update_weights", json={"version": "nope"})
    assert r.status_code == 404, r.text  # validated while asleep: a bad one is refused
    r = post(ustack, "/v1/update_weights", json={"version": "d0"})
    assert r.status_code == 200, r.text
    st = ustack.status()
    assert st["state"] == "sleeping" and st["weight_version"] == "d0"
    r = post(ustack, "/v1/wakeup?tags=weight")
    assert r.status_code == 200, r.text
    assert serving(ustack, "d0") and digests(ustack) == earlier


def test_transient_failure_is_kept_and_retried(ustack: Stack) -> None:
    pid = ustack.status()["ranks"][1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        want = publish(ustack, "k1", seed=81, ipc=True)
        wait_for(lambda: any(e["action"] == "failed" for e in auto_events(ustack, "k1")))
        fail = next(e for e in auto_events(ustack, "k1") if e["action"] == "failed")
        assert fail["error_code"] == 503 and fail["retry"] is True, fail
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: serving(ustack, "k1"), timeout=60)
    assert digests(ustack) == want


def test_operator_rollback_survives_an_engine_restart(ustack: Stack) -> None:
    """Auto-update never re-applies the newest version after a deliberate rollback; nor
    does an engine the launcher restarts (it takes its state back and follows its durable,
    with no catch-up to the newest published)."""
    earlier = publish(ustack, "o1", seed=90, ipc=True)
    publish(ustack, "o2", seed=91, ipc=True)
    wait_for(lambda: serving(ustack, "o2"))
    assert post(ustack, "/v1/pause").status_code == 200
    assert post(ustack, "/v1/update_weights", json={"version": "o1"}).status_code == 200
    assert post(ustack, "/v1/resume").status_code == 200
    kill_engine_and_wait_for_the_next(ustack)
    time.sleep(3)  # a catch-up would have started by now
    assert serving(ustack, "o1") and digests(ustack) == earlier
    assert not [e for e in auto_events(ustack, "o2") if e["action"] == "updated"][1:]
    # a new version awaited (files not there yet): the one rolled back from is not what
    # the restored engine serves meanwhile
    announce_only(ustack, "o3")
    wait_for(lambda: any(e["action"] == "waiting" for e in auto_events(ustack, "o3")))
    time.sleep(3)  # several looks
    assert serving(ustack, "o1") and digests(ustack) == earlier
    publish(ustack, "o3", seed=92, ipc=True)
    wait_for(lambda: serving(ustack, "o3"))


def test_a_deleted_durable_is_made_again_and_updates_go_on(ustack: Stack) -> None:
    """Its durable consumer deleted (`nats consumer rm`, JetStream state lost): every
    fetch failed for ever and auto-update stopped without a word; it subscribes again."""
    durable = durable_name(ustack.instance, model_of(ustack))

    async def rm(nc: Any) -> bool:
        js = nc.jetstream()
        for _ in range(100):  # made by the engine's auto_update task once it runs
            try:
                await js.consumer_info(CKPT_STREAM, durable)
                break
            except NotFoundError:
                await asyncio.sleep(0.1)
        return bool(await js.delete_consumer(CKPT_STREAM, durable))

    assert asyncio.run(_raw(ustack.nats_url, rm))
    want = publish(ustack, "g1", seed=95, ipc=True)
    wait_for(lambda: serving(ustack, "g1"))
    assert digests(ustack) == want


def announce_only(stack: Stack, version: str) -> int:
    """Only the version event (a trainer-role client's, or one ahead of its upload):
    the files are not there."""
    ev = VersionPublished(model_of(stack), version, 2)
    return int(asyncio.run(_raw(stack.nats_url, lambda nc: objstore.publish_version(nc, ev))))


def waited_undisturbed(stack: Stack, version: str, states_before: int) -> str:
    """Auto-update waits for ``version``'s files: said once, never paused for them (in
    keep mode every attempt used to freeze generation: pause → 404 → resume, for ever).
    Returns the reason it gave."""
    wait_for(lambda: any(e["action"] == "waiting" for e in auto_events(stack, version)))
    time.sleep(4)  # several looks (0.25 s doubling to 2 s): still one event, no pause
    got = auto_events(stack, version)
    assert [e["action"] for e in got] == ["waiting"], got
    assert events(stack, "state")[states_before:] == []  # never paused, never resumed
    st = stack.status()
    assert st["state"] == "running"
    # status says why it is running behind the newest: waiting for these files
    assert st["auto_update_waiting"]["version"] == version, st
    assert st["auto_update_waiting"]["reason"] == got[0]["reason"], st
    return str(got[0]["reason"])


def test_an_event_whose_files_are_not_there_waits_without_pausing(ustack: Stack) -> None:
    before = len(events(ustack, "state"))
    serving_before = ustack.status()["weight_version"]
    announce_only(ustack, "w1")
    why = waited_undisturbed(ustack, "w1", before)
    assert "no versions/w1" in why and "manifest.json in bucket" in why, why
    assert ustack.status()["weight_version"] == serving_before
    want = publish(ustack, "w1", seed=97)  # its objects land (its event: a duplicate)
    wait_for(lambda: serving(ustack, "w1"))
    assert digests(ustack) == want
    assert ustack.status()["auto_update_waiting"] is None
    assert [e["action"] for e in auto_events(ustack, "w1")] == ["waiting", "updated"]


def incomplete_is_waited_for(ustack: Stack, version: str) -> str:
    """An incomplete version dir: update_weights says 404 "not complete yet" (paused by
    hand, then resumed); announced, auto-update waits for it without a pause. Returns
    the reason it gave for waiting."""
    assert post(ustack, "/v1/pause").status_code == 200
    r = post(ustack, "/v1/update_weights", json={"version": version})
    assert r.status_code == 404 and "not complete yet" in r.text, r.text
    assert post(ustack, "/v1/resume").status_code == 200
    before = len(events(ustack, "state"))
    announce_only(ustack, version)
    return waited_undisturbed(ustack, version, before)


def test_a_snapshot_dir_mid_copy_waits_a_complete_broken_one_is_refused(
    ustack: Stack, tmp_path: Path
) -> None:
    """A version dir caught mid-copy (a shard shorter than its manifest says) is not
    there yet: 404 over HTTP, waited for by auto-update (before: 422, refused for good).
    Complete but with a wrong byte it is still a 422, refused."""
    cfg = ModelConfig.from_hf(model_config(ustack.model_dir))
    src = tmp_path / "src"
    man = write_sharded_dir(src, cfg, sharding.init_weights(cfg, 7), 2, model_of(ustack), "m1")
    dst = ustack.model_dir / "versions" / "m1"
    dst.mkdir(parents=True)
    shard1 = (src / man.shards[1].file).read_bytes()
    for name in ("manifest.json", man.shards[0].file):
        shutil.copy(src / name, dst / name)
    (dst / man.shards[1].file).write_bytes(shard1[: len(shard1) // 2])  # being copied
    why = incomplete_is_waited_for(ustack, "m1")
    assert f"rank1-of-2.safetensors has {len(shard1) // 2} of {len(shard1)} bytes" in why, why
    (dst / man.shards[1].file).write_bytes(shard1)  # the copy ends
    wait_for(lambda: serving(ustack, "m1"))
    assert [e["action"] for e in auto_events(ustack, "m1")] == ["waiting", "updated"]

    bad = ustack.model_dir / "versions" / "m2"
    shutil.copytree(dst, bad)
    flipped = bytearray(shard1)
    flipped[-1] ^= 1  # complete, one byte wrong: broken for good
    (bad / man.shards[1].file).write_bytes(bytes(flipped))
    announce_only(ustack, "m2")
    wait_for(lambda: any(e["action"] == "failed" for e in auto_events(ustack, "m2")))
    fail = next(e for e in auto_events(ustack, "m2") if e["action"] == "failed")
    assert fail["error_code"] == 422 and fail["retry"] is False, fail
    assert "SHA-256" in fail["error_message"], fail
    assert serving(ustack, "m1")


def test_a_manifest_still_being_copied_is_waited_for_not_refused(
    ustack: Stack, tmp_path: Path
) -> None:
    """``cp -r`` creates ``manifest.json`` empty, then writes it: a dir caught in between
    (every shard complete) is a copy in progress — 404, waited for without a pause —,
    never a 422 that auto-update refuses for good (and stores as refused)."""
    cfg = ModelConfig.from_hf(model_config(ustack.model_dir))
    src = tmp_path / "src"
    write_sharded_dir(src, cfg, sharding.init_weights(cfg, 11), 2, model_of(ustack), "c1")
    dst = ustack.model_dir / "versions" / "c1"
    shutil.copytree(src, dst)
    manifest = (dst / "manifest.json").read_bytes()
    (dst / "manifest.json").write_bytes(b"")  # created, not written yet
    why = incomplete_is_waited_for(ustack, "c1")
    assert "manifest.json has 0 bytes" in why, why
    (dst / "manifest.json").write_bytes(manifest[: len(manifest) // 2])  # being written
    time.sleep(3)
    assert [e["action"] for e in auto_events(ustack, "c1")] == ["waiting"]
    (dst / "manifest.json").write_bytes(manifest)  # the copy ends
    wait_for(lambda: serving(ustack, "c1"))
    assert [e["action"] for e in auto_events(ustack, "c1")] == ["waiting", "updated"]


def test_many_events_ahead_of_their_files_do_not_stall_the_feed(ustack: Stack) -> None:
    """Events whose files never come (announced ahead of an upload that failed) are
    superseded by each newer one: settled (acked) then, so they never pile up to the
    durable's max_ack_pending (1000) — past which JetStream delivers no newer event and
    auto-update would wait for an old version for ever, blind to one that is there."""
    names = [f"gone{i}" for i in range(1100)]

    async def flood(nc: Any) -> None:
        for v in names:
            await objstore.publish_version(nc, VersionPublished(model_of(ustack), v, 2))

    asyncio.run(_raw(ustack.nats_url, flood))
    want = publish(ustack, "after-flood", seed=99)
    wait_for(lambda: serving(ustack, "after-flood"), 120)
    assert digests(ustack) == want


def test_ipc_auto_update_burst_ends_at_newest(ustack: Stack) -> None:
    """Three versions published at once: auto-update ends at the newest, in publish order,
    never back. (Was test_checkpoints' on a stack of its own with the same settings bar
    CONTROL_TIMEOUT_S; here it counts only the version events it causes.)"""
    already = len(events(ustack, "version"))
    want = {}
    for i, v in enumerate(("b1", "b2", "b3")):
        want[v] = publish(ustack, v, seed=31 + i, ipc=True)
    wait_for(lambda: serving(ustack, "b3"))
    assert digests(ustack) == want["b3"]
    mine = events(ustack, "version")[already:]
    seen = [e["data"]["version"] for e in mine]
    assert seen[-1] == "b3" and seen == sorted(seen)  # in publish order, never back
    assert all(e["data"]["actor"] == "auto_update" for e in mine)
    # the old versions' events were acked and ignored or superseded, never re-applied
    time.sleep(1.5)
    assert ustack.status()["weight_version"] == "b3"


def test_auto_update_failure_resumes_on_previous_weights(ustack: Stack) -> None:
    before, version_before = digests(ustack), ustack.status()["weight_version"]
    pub = CheckpointPublisher(ustack.nats_url)
    blobs, man = pub.prepare(
        model_of(ustack), "broken", training_state(ustack, 41), 2, model_config(ustack.model_dir)
    )
    man.shards[0].sha256 = "f" * 64
    d = ipc_version_dir(SHM, model_of(ustack), "broken")
    d.mkdir(parents=True, exist_ok=True)
    for spec, blob in zip(man.shards, blobs, strict=True):
        (d / spec.file).write_bytes(blob)
    (d / "manifest.json").write_bytes(mf.encode(man))

    async def announce(nc: Any) -> None:
        await objstore.publish_version(nc, VersionPublished(model_of(ustack), "broken", 2))

    asyncio.run(_raw(ustack.nats_url, announce))
    wait_for(lambda: any(e["action"] == "failed" for e in auto_events(ustack, "broken")))
    fail = next(e for e in auto_events(ustack, "broken"))
    assert fail["error_code"] == 422 and "rank 0" in fail["error_message"]
    st = ustack.status()
    assert st["state"] == "running" and st["weight_version"] == version_before
    assert digests(ustack) == before


def test_an_older_loadable_version_is_served_while_the_newest_is_waited_for(
    ustack: Stack, tmp_path: Path
) -> None:
    """Two announcements ahead of their files (a snapshot copy in progress for each):
    the older one's copy ends first. It is served meanwhile — the freshest weights
    there are, without a stall —, the newest still waited for and served once its
    files land. Before, the engine stayed on its old version until the newest one's
    files came (for good if they never did): the older one's event had been settled
    as superseded."""
    announce_two_waited_for(ustack, "mw1", "mw2")
    for v, seed in (("mw1", 61), ("mw2", 62)):
        land_and_serve(ustack, tmp_path, v, seed)
        assert ustack.status()["auto_update_waiting"] == (
            {"version": "mw2", "reason": auto_events(ustack, "mw2")[0]["reason"], "since": ANY}
            if v == "mw1"
            else None
        )
    assert [e["action"] for e in auto_events(ustack, "mw2")] == ["waiting", "updated"]


@pytest.mark.parametrize("garbage", [b"\x00not json{", b'{"model": 1}'], ids=["bytes", "json"])
def test_an_event_for_a_version_whose_manifest_is_garbage_is_refused_once(
    ustack: Stack, garbage: bytes
) -> None:
    """A version whose ``manifest.json`` object is garbage (a foreign writer, `nats pub`
    of an event by hand): its files "are there", the update is a 422 — refused for good,
    no retry loop of pauses —, the engine stays on its version and running, and the
    next good version is served."""
    version = f"gm-{garbage[:1].hex()}"
    serving_before = ustack.status()["weight_version"]

    async def plant(nc: Any) -> None:
        await objstore.ensure_bucket(nc, "rollbus_ckpt")
        name = f"{model_of(ustack)}/{version}/manifest.json"
        await objstore.put_object(nc, "rollbus_ckpt", name, garbage)

    asyncio.run(_raw(ustack.nats_url, plant))
    announce_only(ustack, version)
    wait_for(lambda: any(e["action"] == "failed" for e in auto_events(ustack, version)))
    time.sleep(2)  # a retry would show by now (1 s backoff)
    got = auto_events(ustack, version)
    assert [e["action"] for e in got] == ["failed"], got
    assert got[0]["error_code"] == 422 and got[0]["retry"] is False, got
    assert "manifest.json" in got[0]["error_message"], got
    assert serving(ustack, serving_before)
    want = publish(ustack, f"{version}-ok", seed=71, ipc=True)
    wait_for(lambda: serving(ustack, f"{version}-ok"))
    assert digests(ustack) == want


def test_an_engine_restarted_mid_wait_takes_the_versions_as_their_files_land(
    ustack: Stack, tmp_path: Path
) -> None:
    """The engine dies (SIGKILL) while it waits for the newest version's files, an older
    announced one's files also missing. The restored engine goes on waiting: the older
    one is served as soon as its files land, the newest as soon as its files do. Before,
    the awaited event (held, un-acked) came back from the durable only after its ack
    wait (10 min), and the older one (acked as superseded) never."""
    announce_two_waited_for(ustack, "rw1", "rw2")
    kill_engine_and_wait_for_the_next(ustack)
    # the restored engine says what it waits for
    wait_for(lambda: (ustack.status()["auto_update_waiting"] or {}).get("version") == "rw2")
    for v, seed in (("rw1", 63), ("rw2", 64)):
        land_and_serve(ustack, tmp_path, v, seed)
