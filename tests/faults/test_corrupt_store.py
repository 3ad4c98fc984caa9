"""Checkpoint bytes corrupted on nats-server's disk (one bit of a stored chunk, the server
stopped, the block file edited, the server started again on it): the JetStream object
store must never hand those bytes to a rank as a version, whatever ``verify_checksum``
says. nats-server checks each stored message's checksum when it loads it and drops a
bad one; the ranks' reader then finds a chunk missing (its count and sequence checks)
and the update is a 422 naming the rank and object — the served version stays, on
every rank."""

from __future__ import annotations

import signal
from pathlib import Path

from services.trainer.publisher import CheckpointPublisher
from shared import sharding
from shared.model_config import ModelConfig
from tests.e2e.stack import model_config
from tests.e2e.test_control import digests
from tests.faults import common as c
from tests.faults.common import Faults


def _find_stored(store: Path, needle: bytes) -> tuple[Path, int]:
    """The one place of the object stream's block files holding ``needle`` (bytes from
    the middle of a shard: chunks are stored as sent)."""
    hits = []
    for blk in sorted(store.glob("jetstream/*/streams/OBJ_rollbus_ckpt/msgs/*.blk")):
        data = blk.read_bytes()
        if (i := data.find(needle)) >= 0:
            hits.append((blk, i))
    assert len(hits) == 1, hits
    return hits[0]


def _flip_bit(blk: Path, at: int) -> None:
    with open(blk, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
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
    blk, at = _find_stored(nats.store, shard[len(shard) // 2 : len(shard) // 2 + 64])
    _flip_bit(blk, at + 10)
    nats.start()
    try:
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
    finally:
        # the session's store must be whole again: on an unclean restart (a later test
        # SIGKILLs the server after writing) nats-server rebuilds the block and cuts it at
        # the bad record, and every object stored after it was lost (test_nats's p1: 404)
        nats.stop()
        _flip_bit(blk, at + 10)
        nats.start()
    # proof: an object written now survives a SIGKILL and the rebuild it causes
    later = sharding.init_weights(ModelConfig.from_hf(cfg), 72)
    pub.publish("tiny", "disk2", later, tp=2, config=cfg)
    nats.kill(signal.SIGKILL)
    nats.start()
    c.wait_recovered(stack)
    assert c.ctl(stack, "/v1/pause").status_code == 200
    r = c.ctl(stack, "/v1/update_weights", json={"version": "disk2"})
    assert r.status_code == 200, r.text
