"""Two trainers publishing one version name at once: versions stay immutable. Exactly
one publish uploads; the other waits for its manifest and is a no-op (same content) or
:class:`VersionConflict` (other content); the stored shards always match the stored
manifest. A claim left by a publisher that died is taken over. Real publishers, real
nats-server."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

import pytest

from services.tiny_model import TINY_CONFIG
from services.trainer import names, publisher
from services.trainer.publisher import CheckpointPublisher, VersionConflict
from shared import manifest as mf
from shared import objstore, sharding
from shared.bus import Bus
from shared.model_config import ModelConfig
from shared.subjects import ckpt_object_name

CFG = {
    **TINY_CONFIG,
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
BUCKET = "rollbus_ckpt"


def _state(seed: int) -> dict[str, Any]:
    cfg = ModelConfig.from_hf(CFG)
    return names.to_training(sharding.init_weights(cfg, seed), cfg)


async def _stored_is_whole(nats_url: str, model: str, version: str) -> mf.Manifest:
    """The stored manifest, after checking every shard's bytes against it."""
    bus = await Bus.connect(nats_url, "check")
    try:
        raw = await objstore.read_object(
            bus.nc, BUCKET, ckpt_object_name(model, version, "manifest.json")
        )
        man = mf.decode(bytes(raw))
        for s in man.shards:
            data = await objstore.read_object(
                bus.nc, BUCKET, ckpt_object_name(model, version, s.file)
            )
            assert hashlib.sha256(data).hexdigest() == s.sha256, f"rank {s.rank}'s shard"
        return man
    finally:
        await bus.close()


@pytest.mark.parametrize("same", [False, True], ids=["other-content", "same-content"])
async def test_concurrent_publishes_of_one_version_leave_one_whole_version(
    nats_url: str, same: bool
) -> None:
    model = f"cc-{uuid.uuid4().hex[:6]}"
    states = [_state(1), _state(1 if same else 2)]
    pubs = [CheckpointPublisher(nats_url), CheckpointPublisher(nats_url)]
    got = await asyncio.gather(
        *(p.apublish(model, "v1", s, tp=2, config=CFG) for p, s in zip(pubs, states, strict=True)),
        return_exceptions=True,
    )
    ok = [r for r in got if isinstance(r, publisher.PublishResult)]
    conflicts = [r for r in got if isinstance(r, VersionConflict)]
    assert len(ok) + len(conflicts) == 2, got
    # one upload; the other publisher either found the same content or was refused
    assert sum(r.uploaded for r in ok) == 1, got
    assert len(conflicts) == (0 if same else 1), got
    man = await _stored_is_whole(nats_url, model, "v1")
    winner = next(r for r in ok if r.uploaded)
    assert man.total_bytes == winner.bytes
    assert len({r.seq for r in ok}) == 1  # one announcement


async def test_a_claim_left_by_a_dead_publisher_is_taken_over(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = f"cd-{uuid.uuid4().hex[:6]}"
    monkeypatch.setattr(publisher, "CLAIM_STALE_S", 1.0)
    bus = await Bus.connect(nats_url, "dead")
    try:
        await objstore.ensure_bucket(bus.nc, BUCKET)
        dead = publisher._Claim(
            bus.nc, BUCKET, ckpt_object_name(model, "v1", "manifest.json"), "dead"
        )
        assert await dead.take() is None  # held, and never refreshed nor released
    finally:
        await bus.close()
    res = await CheckpointPublisher(nats_url).apublish(model, "v1", _state(3), tp=2, config=CFG)
    assert res.uploaded
    await _stored_is_whole(nats_url, model, "v1")
    # the wait was said (once), naming whose claim: before, `rollbus publish` was silent
    waits = [r for r in caplog.records if "holds this version; waiting" in r.getMessage()]
    assert len(waits) == 1 and "(dead)" in waits[0].getMessage()


async def test_a_claim_whose_answer_was_lost_is_still_ours(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a claim write that timed out may have landed: the publisher must know its own claim
    # (else it waits for itself, then fails its own manifest's compare-and-set)
    monkeypatch.setattr(publisher, "CLAIM_STALE_S", 600.0)
    model = f"co-{uuid.uuid4().hex[:6]}"
    name = ckpt_object_name(model, "v1", "manifest.json")
    bus = await Bus.connect(nats_url, "own")
    try:
        await objstore.ensure_bucket(bus.nc, BUCKET)
        first = publisher._Claim(bus.nc, BUCKET, name, "me")
        assert await first.take() is None
        again = publisher._Claim(bus.nc, BUCKET, name, "me")
        again.id = first.id  # the same publisher, which did not hear the answer
        assert await asyncio.wait_for(again.take(), 10) is None
        assert again.seq == first.seq and await again.mine()
        first.seq = 0  # its answer lost: a stale sequence
        assert await first.mine() and first.seq == again.seq
    finally:
        await bus.close()


async def test_claim_and_release_markers_are_deleted_objects_to_nats_py(nats_url: str) -> None:
    # a claim left by a dead publisher, or released by a failed one, stays the name's last
    # meta: another NATS object-store client must still read the bucket (nats-py's `list`
    # hung, its get_info / put raised BadObjectMetaError: the markers had no nuid)
    model = f"cm-{uuid.uuid4().hex[:6]}"
    bus = await Bus.connect(nats_url, "marker")
    try:
        await objstore.ensure_bucket(bus.nc, BUCKET)
        store = await bus.nc.jetstream().object_store(BUCKET)
        for version in ("v1", "v2"):
            name = ckpt_object_name(model, version, "manifest.json")
            claim = publisher._Claim(bus.nc, BUCKET, name, "marker")
            assert await claim.take() is None
            if version == "v2":
                await claim.release()
                assert "claim" not in (await objstore.last_meta(bus.nc, BUCKET, name))[1]
            info = await asyncio.wait_for(store.get_info(name, show_deleted=True), 10)
            assert info.deleted
            with pytest.raises(objstore.ObjectMissing):  # rollbus readers: no object
                await objstore.get_meta(bus.nc, BUCKET, name)
        names = [i.name for i in await asyncio.wait_for(store.list(ignore_deletes=False), 10)]
        assert ckpt_object_name(model, "v1", "manifest.json") in names
    finally:
        await bus.close()


async def test_the_upload_ends_while_a_refresh_is_being_written(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the refresh is stopped when the upload ends, maybe in the middle of its claim write:
    # that stop must not be lost (nats-py's request waits in asyncio.wait_for, which on
    # Python < 3.12 swallows a cancel that comes as the answer does: the refresh then ran
    # on for ever and the publish never ended), and the manifest's compare-and-set must
    # expect the claim as last written (not a spurious VersionConflict)
    monkeypatch.setattr(publisher, "CLAIM_REFRESH_S", 0.001)  # always writing
    model = f"cr-{uuid.uuid4().hex[:6]}"
    bus = await Bus.connect(nats_url, "refresh")

    async def upload(i: int) -> bool:
        await asyncio.sleep(0.002 * (i % 7))
        return True

    try:
        await objstore.ensure_bucket(bus.nc, BUCKET)
        for i in range(40):
            name = ckpt_object_name(model, f"v{i}", "manifest.json")
            claim = publisher._Claim(bus.nc, BUCKET, name, "me")
            assert await claim.take() is None
            assert await asyncio.wait_for(claim.hold_while(upload(i)), 30)
            assert await claim.mine()
            await objstore.put_object(bus.nc, BUCKET, name, b"{}", expect_seq=claim.seq)
    finally:
        await bus.close()


async def test_a_publish_failing_at_its_manifest_leaves_no_shard_behind(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard stored, then the manifest's write fails (a cut connection, a cancel):
    the shards it completed are deleted and their chunks purged, the claim released.
    Before, the completed shards' bytes stayed in the bucket, under no manifest."""
    model = f"cm-{uuid.uuid4().hex[:6]}"
    real = objstore.put_object

    async def put(nc: Any, bucket: str, name: str, *a: Any, **kw: Any) -> Any:
        if name.endswith("manifest.json"):
            raise objstore.ObjectReadError(f"put {bucket}/{name}: connection cut (test)")
        return await real(nc, bucket, name, *a, **kw)

    monkeypatch.setattr(objstore, "put_object", put)
    with pytest.raises(objstore.ObjectReadError):
        await CheckpointPublisher(nats_url).apublish(model, "v1", _state(4), tp=2, config=CFG)
    bus = await Bus.connect(nats_url, "check")
    try:
        js = bus.nc.jetstream()
        for r in range(2):
            _, info = await objstore.last_meta(
                bus.nc, BUCKET, ckpt_object_name(model, "v1", f"rank{r}-of-2.safetensors")
            )
            assert info.get("deleted"), info  # no shard object left
            st = await js.stream_info(
                f"OBJ_{BUCKET}", subjects_filter=f"$O.{BUCKET}.C.{info['nuid']}"
            )
            assert not st.state.subjects, st.state.subjects  # its chunks purged
        _, claim = await objstore.last_meta(
            bus.nc, BUCKET, ckpt_object_name(model, "v1", "manifest.json")
        )
        assert claim.get("deleted") and "claim" not in claim  # released
    finally:
        await bus.close()


async def test_a_publisher_that_lost_its_claim_keeps_chunks_a_published_shard_names(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publisher stalled past CLAIM_STALE_S (alive: SIGSTOP, a partition) whose claim
    another took over, and which then stores one shard (the same bytes) over the other's
    before its refresh notices: that shard's meta now names its chunks, in the version
    the other published. Its abandon must not purge them (the version would be
    unreadable); only chunks no shard names go."""
    monkeypatch.setattr(publisher, "CLAIM_STALE_S", 1.0)
    model = f"cs-{uuid.uuid4().hex[:6]}"
    name = ckpt_object_name(model, "v1", "manifest.json")
    pub = CheckpointPublisher(nats_url)
    bus = await Bus.connect(nats_url, "stalled")
    try:
        await objstore.ensure_bucket(bus.nc, BUCKET)
        nuids = [objstore.new_nuid(bus.nc) for _ in range(2)]
        stalled = publisher._Claim(bus.nc, BUCKET, name, "stalled", nuids)
        assert await stalled.take() is None  # then stalls: no refresh
        res = await pub.apublish(model, "v1", _state(5), tp=2, config=CFG)  # takes it over
        assert res.uploaded
        man = await _stored_is_whole(nats_url, model, "v1")
        shard = ckpt_object_name(model, "v1", man.shards[0].file)
        data = bytes(await objstore.read_object(bus.nc, BUCKET, shard))
        # the stalled one resumes: its put of shard 0 began after the other's was stored
        await objstore.put_object(bus.nc, BUCKET, shard, data, cas=True, nuid=nuids[0])
        assert not await stalled.mine()
        await pub._abandon(bus.nc, model, "v1", 2, stalled)  # its refresh failed
    finally:
        await bus.close()
    await _stored_is_whole(nats_url, model, "v1")


@pytest.mark.parametrize("fence", [True, False], ids=["server-fence", "look-first"])
async def test_a_shard_write_of_a_publisher_that_lost_its_claim_is_refused(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, fence: bool
) -> None:
    """A stalled holder resumes after another took its claim over, before the taker
    wrote this shard: its shard write must fail (the shard's own compare-and-set passed
    it — nobody had written the shard —, and the taker's put then failed instead: the
    version not published, by either). The taker's write lands."""
    monkeypatch.setattr(publisher, "CLAIM_STALE_S", 1.0)
    model = f"cf-{uuid.uuid4().hex[:6]}"
    name = ckpt_object_name(model, "v1", "manifest.json")
    shard = ckpt_object_name(model, "v1", "rank0-of-1.safetensors")
    bus = await Bus.connect(nats_url, "fence")
    try:
        await objstore.ensure_bucket(bus.nc, BUCKET)
        stalled = publisher._Claim(bus.nc, BUCKET, name, "stalled")
        taker = publisher._Claim(bus.nc, BUCKET, name, "taker")
        stalled.fence = taker.fence = fence and objstore.can_fence(bus.nc)
        assert await stalled.take() is None
        assert await taker.take() is None  # after 1 s unchanged
        info = {"name": shard, "bucket": BUCKET, "nuid": "x", "size": 1, "chunks": 1}
        if stalled.fence:
            # the server checks the claim in the write itself: even a look that saw the
            # claim as ours (just before the takeover: the stall right between look and
            # write that the look-first fallback cannot cover) does not let it land

            async def looked_before_the_takeover() -> bool:
                return True

            monkeypatch.setattr(stalled, "mine", looked_before_the_takeover)
        with pytest.raises(objstore.ObjectConflict):
            await stalled.writer(shard)({**info, "nuid": "stalled"}, 0)
        await taker.writer(shard)({**info, "nuid": "taker"}, 0)
        _, last = await objstore.last_meta(bus.nc, BUCKET, shard)
        assert last["nuid"] == "taker"
    finally:
        await bus.close()
