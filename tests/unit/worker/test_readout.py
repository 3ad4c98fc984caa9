"""The rank side of the read-only weights subjects: snapshot, chunks, limits (no bus)."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import pytest

from services.worker.readout import Reads
from shared import readout as ro
from shared.errors import ControlError


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"b": rng.standard_normal((3, 5)).astype(np.float32),
            "a": np.arange(7, dtype=np.int64)}


def test_snapshot_and_chunks_rebuild_every_tensor() -> None:
    reads = Reads(1, 2, max_payload=1 << 20)
    opened = msgspec.convert(reads.open_read("v3", tensors(), ro.ReadArgs(16)), ro.ReadOpen)
    assert opened.rank == 1 and opened.tp == 2 and opened.version == "v3"
    assert [e.name for e in opened.tensors] == ["a", "b"] and opened.chunk_bytes == 1024
    buf = bytearray()
    while len(buf) < opened.size:
        c = reads.chunk(ro.ChunkArgs(opened.read_id, len(buf)))
        assert c.error_code == 200 and c.offset == len(buf)
        buf += c.data
    assert hashlib.sha256(buf).hexdigest() == opened.sha256
    for e in opened.tensors:
        got = np.frombuffer(buf, e.dtype, e.nbytes // np.dtype(e.dtype).itemsize, e.offset)
        assert np.array_equal(got.reshape(e.shape), tensors()[e.name])
    assert reads.chunk(ro.ChunkArgs(opened.read_id, close=True)).error_code == 200
    gone = reads.chunk(ro.ChunkArgs(opened.read_id, 0))
    assert gone.error_code == 404 and "no open weight read" in gone.error_message


def test_chunks_fit_max_payload() -> None:
    reads = Reads(0, 1, max_payload=8192)
    opened = reads.open_read("v", {"w": np.zeros(10_000, np.float32)}, ro.ReadArgs(1 << 20))
    assert opened["chunk_bytes"] == 8192 - ro.HEADROOM
    c = reads.chunk(ro.ChunkArgs(opened["read_id"], 0))
    assert len(c.data) == 8192 - ro.HEADROOM


def test_limits_asleep_bad_offset_and_idle_expiry() -> None:
    reads = Reads(0, 1, max_payload=1 << 20)
    with pytest.raises(ControlError) as e:
        reads.open_read("v", None, ro.ReadArgs())
    assert e.value.code == 409 and "asleep" in e.value.message
    ids = [reads.open_read("v", tensors(), ro.ReadArgs())["read_id"] for _ in range(ro.MAX_OPEN)]
    with pytest.raises(ControlError) as e:
        reads.open_read("v", tensors(), ro.ReadArgs())
    assert e.value.code == 409 and "open already" in e.value.message
    assert reads.chunk(ro.ChunkArgs(ids[0], 10**9)).error_code == 400
    reads.expire(now=reads.open[ids[1]].used + ro.IDLE_S + 1)
    assert reads.open == {}  # idle reads dropped: a new one opens
    reads.open_read("v", tensors(), ro.ReadArgs())
