"""The checkpoint publish path against a real nats-server: shards written on threads
while they are sent, several ranks at once, a bounded window of unacknowledged chunks,
and the bytes and SHA-256 that arrive identical to a plain serialization."""

from __future__ import annotations

import hashlib
import sys
import uuid
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest
from safetensors.numpy import save

from services.tiny_model import TINY_CONFIG, create_model_dir
from services.trainer import names, publisher, shards
from services.trainer.publisher import CheckpointPublisher, VersionConflict
from shared import manifest as mf
from shared import objstore, sharding
from shared.model_config import ModelConfig
from shared.subjects import ckpt_object_name

MIB = 1 << 20
# ~12 MiB fp32 at tp=2: every shard spans several 1 MiB chunks
CFG = {**TINY_CONFIG, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}


def _plain_blobs(cfg: ModelConfig, hf: dict[str, np.ndarray], tp: int) -> list[bytes]:
    """The reference: contiguous shards written by safetensors itself."""
    return [save(s) for s in shards.shard_state(cfg, hf, tp)]


async def _read_all(url: str, model: str, version: str) -> tuple[mf.Manifest, list[bytes]]:
    nc = await nats.connect(url)
    try:
        raw = await objstore.read_object(nc, "rollbus_ckpt", f"{model}/{version}/manifest.json")
        man = mf.decode(bytes(raw))
        out = []
        for s in man.shards:
            name = ckpt_object_name(model, version, s.file)
            buf = await objstore.read_object(nc, "rollbus_ckpt", name, expect_sha256=s.sha256)
            meta = await objstore.get_meta(nc, "rollbus_ckpt", name)
            assert meta.digest == s.sha256 and meta.size == s.size
            out.append(bytes(buf[: s.size]))
        return man, out
    finally:
        await nc.close()


async def test_state_dict_round_trip_bytes_and_sha_identical(nats_url: str) -> None:
    cfg = ModelConfig.from_hf(CFG)
    hf = sharding.init_weights(cfg, 5)
    train = names.to_training(hf, cfg)  # paddle layout: transposed linears
    model = f"pub-{uuid.uuid4().hex[:6]}"
    pub = CheckpointPublisher(nats_url)
    seen: list[tuple[int, int]] = []
    res = await pub.apublish(model, "v1", train, tp=2, config=CFG,
                             progress=lambda d, t: seen.append((d, t)))
    assert res.uploaded and res.bytes > 8 * MIB
    man, got = await _read_all(nats_url, model, "v1")
    want = _plain_blobs(cfg, hf, 2)
    assert got == want  # byte for byte what safetensors itself writes
    assert [s.sha256 for s in man.shards] == [hashlib.sha256(b).hexdigest() for b in want]
    assert seen[-1] == (res.bytes, res.bytes)
    assert all(a <= b for (a, _), (b, _) in zip(seen, seen[1:], strict=False))
    # re-publishing the same content: nothing uploaded; other content: refused
    again = await pub.apublish(model, "v1", train, tp=2, config=CFG)
    assert not again.uploaded and again.seq == res.seq
    other = names.to_training(sharding.init_weights(cfg, 6), cfg)
    with pytest.raises(VersionConflict):
        await pub.apublish(model, "v1", other, tp=2, config=CFG)


async def test_ring_smaller_than_shard_round_trip(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard is written into a ring of reused memory far smaller than the shard
    (here as small as it may be: one fill block plus one chunk); what arrives is still
    byte for byte the reference, and the ring's memory was really reused."""
    rings: list[tuple[int, int]] = []

    def tight(lay: shards.ShardLayout) -> int:
        size = -(-(lay.max_block() + objstore.CHUNK_SIZE) // MIB) * MIB
        rings.append((size, lay.size))
        return size

    monkeypatch.setattr(publisher, "_ring_size", tight)
    cfg = ModelConfig.from_hf(CFG)
    hf = sharding.init_weights(cfg, 7)
    model = f"ring-{uuid.uuid4().hex[:6]}"
    pub = CheckpointPublisher(nats_url)
    res = await pub.apublish(model, "r1", names.to_training(hf, cfg), tp=2, config=CFG)
    assert res.uploaded
    assert len(rings) == 2 and all(r * 3 // 2 < size for r, size in rings)  # wraps around
    kept = {id(r) for r in pub._rings.free}
    assert len(kept) == 2
    hf2 = sharding.init_weights(cfg, 8)  # the next version: the same rings, reused
    await pub.apublish(model, "r2", names.to_training(hf2, cfg), tp=2, config=CFG)
    assert {id(r) for r in pub._rings.free} == kept
    for version, state in (("r1", hf), ("r2", hf2)):
        man, got = await _read_all(nats_url, model, version)
        want = _plain_blobs(cfg, state, 2)
        assert got == want
        assert [s.sha256 for s in man.shards] == [hashlib.sha256(b).hexdigest() for b in want]


async def test_model_dir_round_trip_from_mapped_files(nats_url: str, tmp_path: Path) -> None:
    d = create_model_dir(tmp_path / "hf", CFG, seed=9)
    cfg, state = __import__("services.trainer.publisher", fromlist=["x"]).read_model_dir(d)
    assert all(not a.flags.writeable and not a.flags.owndata
               for a in state.values())  # read-only views of the mapped file, no copy
    model = f"dir-{uuid.uuid4().hex[:6]}"
    await CheckpointPublisher(nats_url).apublish(model, "d1", d, tp=2)
    _, got = await _read_all(nats_url, model, "d1")
    from safetensors.numpy import load_file

    ref = {}
    for f in sorted(d.glob("*.safetensors")):
        ref.update(load_file(str(f)))
    assert got == _plain_blobs(cfg, ref, 2)


async def test_ranks_upload_concurrently(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = objstore.put_object
    live: list[int] = [0]
    peak: list[int] = [0]

    switch: set[float] = set()
    before = sys.getswitchinterval()

    async def spy(*a: Any, **kw: Any) -> Any:
        switch.add(sys.getswitchinterval())
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        try:
            return await real(*a, **kw)
        finally:
            live[0] -= 1

    monkeypatch.setattr(objstore, "put_object", spy)
    cfg = ModelConfig.from_hf(CFG)
    model = f"conc-{uuid.uuid4().hex[:6]}"
    await CheckpointPublisher(nats_url).apublish(
        model, "c1", names.to_training(sharding.init_weights(cfg, 1), cfg), tp=4, config=CFG
    )
    assert peak[0] == 4  # every rank's shard in flight at once (the manifest after)
    # the GIL is handed over quickly while uploading, and the interval restored after
    assert switch == {publisher.SWITCH_INTERVAL} and sys.getswitchinterval() == before
    _, got = await _read_all(nats_url, model, "c1")
    assert got == _plain_blobs(cfg, sharding.init_weights(cfg, 1), 4)


@pytest.mark.parametrize("fast", [True, False], ids=["own-link", "nats-py"])
async def test_put_window_is_bounded(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    from shared import _fastwire

    nc = await nats.connect(nats_url)
    try:
        await objstore.ensure_bucket(nc, "rollbus_ckpt")
        sent = [0]
        worst = [0]
        acked = [0]
        real_publish = nc.publish

        async def publish(subject: str, payload: Any = b"", **kw: Any) -> None:
            if subject.startswith("$O.rollbus_ckpt.C."):
                sent[0] += 1
                worst[0] = max(worst[0], sent[0] - acked[0])
            await real_publish(subject, payload, **kw)

        monkeypatch.setattr(nc, "publish", publish)
        real_writer = objstore._direct_writer

        class Spy:  # chunks written straight to the socket count too
            def __init__(self, w: Any) -> None:
                self.w = w

            def write(self, b: Any) -> None:
                if bytes(b[:22]).startswith(b"PUB $O.rollbus_ckpt.C."):
                    sent[0] += 1
                    worst[0] = max(worst[0], sent[0] - acked[0])
                self.w.write(b)

        def writer(c: Any) -> Any:
            w = real_writer(c)
            return Spy(w) if w is not None else None

        monkeypatch.setattr(objstore, "_direct_writer", writer)
        real_send = _fastwire.Link.send

        async def send(self: Any, *parts: Any) -> None:  # chunks on the writer's own link
            if bytes(parts[0][:22]).startswith(b"PUB $O.rollbus_ckpt.C."):
                sent[0] += 1
                worst[0] = max(worst[0], sent[0] - acked[0])
            await real_send(self, *parts)

        monkeypatch.setattr(_fastwire.Link, "send", send)
        links: list[Any] = []
        real_link = _fastwire.link

        async def link(c: Any, *a: Any, **kw: Any) -> Any:
            lk = await real_link(c, *a, **kw)
            links.append(lk)
            return lk

        monkeypatch.setattr(_fastwire, "link", link)
        data = np.random.default_rng(0).integers(0, 255, 48 * MIB, dtype=np.uint8)

        def progress(n: int) -> None:
            acked[0] = n // MIB

        meta = await objstore.put_object(nc, "rollbus_ckpt", f"w/{uuid.uuid4().hex}",
                                         data.data, progress, fast=fast)
        assert [lk is not None for lk in links] == ([True] if fast else [])
        assert sent[0] == 48 and meta.chunks == 48
        assert 1 < worst[0] <= objstore.PUT_WINDOW  # pipelined, and never more in flight
        assert meta.digest == hashlib.sha256(data.tobytes()).hexdigest()
    finally:
        await nc.close()


async def test_failed_fill_publishes_nothing(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fill = shards.ShardLayout.fill

    def broken(
        self: shards.ShardLayout, buf: Any, sha: Any = None, on_filled: Any = None,
        room: Any = None, **kw: Any,
    ) -> None:
        def half(n: int) -> None:
            if on_filled:
                on_filled(n)
            if self.rank == 1 and n > self.size // 2:
                raise OSError("source tensor unreadable")

        real_fill(self, buf, sha, half, room, **kw)

    monkeypatch.setattr(shards.ShardLayout, "fill", broken)
    cfg = ModelConfig.from_hf(CFG)
    model = f"fail-{uuid.uuid4().hex[:6]}"
    pub = CheckpointPublisher(nats_url)
    with pytest.raises(OSError, match="unreadable"):
        await pub.apublish(model, "f1", sharding.init_weights(cfg, 2), tp=2, config=CFG)
    assert await pub.aversions(model) == []  # never announced
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(objstore.ObjectMissing):
            await objstore.get_meta(nc, "rollbus_ckpt", f"{model}/f1/manifest.json")
        with pytest.raises(objstore.ObjectMissing):  # the half-sent shard is not an object
            await objstore.get_meta(nc, "rollbus_ckpt", f"{model}/f1/rank1-of-2.safetensors")
    finally:
        await nc.close()


async def test_contiguous_tensors_are_sent_from_the_tensor_not_copied(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor whose shard is C-contiguous (an HF-layout state at tp=1: every one) is
    sent from its own memory: nothing of it is copied into the shard's ring. What
    arrives is still byte for byte the reference, with its SHA-256."""
    copied: list[int] = []
    real = np.copyto

    def spy(dst: Any, src: Any, *a: Any, **kw: Any) -> None:
        copied.append(np.asarray(dst).nbytes)
        real(dst, src, *a, **kw)

    monkeypatch.setattr(np, "copyto", spy)
    cfg = ModelConfig.from_hf(CFG)
    hf = sharding.init_weights(cfg, 11)
    model = f"direct-{uuid.uuid4().hex[:6]}"
    res = await CheckpointPublisher(nats_url).apublish(model, "d1", hf, tp=1, config=CFG)
    assert res.uploaded and res.bytes > 8 * MIB
    assert sum(copied) == 0  # without it: the whole shard, copied into the ring
    man, got = await _read_all(nats_url, model, "d1")
    assert got == _plain_blobs(cfg, hf, 1)
    assert man.shards[0].sha256 == hashlib.sha256(got[0]).hexdigest()
