"""Checkpoint bytes corrupted on nats-server's disk (one bit of a stored chunk, the server
stopped, the block file edited, the server started again on it): the JetStream object
store must never hand those bytes to a rank as a version, whatever ``verify_checksum``
says. nats-server checks each stored message's checksum when it loads it and drops a
bad one; the ranks' reader then finds a chunk missing (its count and sequence checks)
and the update is a 422 naming the rank and object — the served version stays, on
every rank."""

from __future__ import annotations

from pathlib import Path

from services.trainer.publisher import CheckpointPublisher
from shared import sharding
from shared.model_config import ModelConfig
from tests.e2e.stack import model_config
from tests.e2e.test_control import digests
from tests.faults import common as c
from tests.faults.common import Faults


def _flip_stored_byte(store: Path, needle: bytes) -> None:
    """Flip one bit in the one place of the object stream's block files holding
    ``needle`` (bytes from the middle of a shard: chunks are stored as sent)."""
    hits = []
    for blk in sorted(store.glob("jetstream/*/streams/OBJ_rollbus_ckpt/msgs/*.blk")):
        data = blk.read_bytes()
        if (i := data.find(needle)) >= 0:
            hits.append((blk, i))
    assert len(hits) == 1, hits
    blk, i = hits[0]
    with open(blk, "r+b") as fh:
        fh.seek(i + 10)
        b = fh.read(1)
        fh.seek(i + 10)
        fh.write(bytes([b[0] ^ 0x01]))


def test_a_chunk_corrupted_on_disk_is_422_and_never_served(faults: Faults) -> None:
    stack, nats = faults.stack, faults.nats
    cfg = model_config(stack.model_dir)
    state = sharding.init_weights(ModelConfig.from_hf(cfg), 71)
    pub = CheckpointPublisher(nats.url)
    pub.publish("tiny", "disk1", state, tp=2, config=cfg)
    shard = bytes(pub.prepare("tiny", "disk1", state, 2, cfg)[0][0])
    before = digests(stack)
    nats.stop()  # SIGTERM: the server writes its index; the block is edited after
    _flip_stored_byte(nats.store, shard[len(shard) // 2 : len(shard) // 2 + 64])
    nats.start()
    c.wait_recovered(stack)  # engine and ranks back on the bus
    assert c.ctl(stack, "/v1/pause").status_code == 200
    for verify in (None, False):
        body = {"version": "disk1"} | ({} if verify is None else {"verify_checksum": verify})
        r = c.ctl(stack, "/v1/update_weights", json=body)
        assert r.status_code == 422, (verify, r.text)
        msg = r.json()["error_message"]
        assert "rank 0: tiny/disk1/rank0-of-2.safetensors: chunks missing" in msg, msg
        assert str(nats.store) not in msg, msg
        assert c.status(stack, fresh=True)["weight_version"] == "v0"
        assert digests(stack) == before  # nothing half-applied on any rank
