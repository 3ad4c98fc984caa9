"""WeightStore: stage, commit, finalize, rollback on real paddle tensors (no bus)."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.tiny_model import TINY_CONFIG, create_model_dir
from services.trainer.shards import write_sharded_dir
from services.worker import hf_files
from services.worker.weights import LoadedShard, SnapshotSource, WeightStore
from shared import sharding
from shared.errors import ControlError
from shared.model_config import ModelConfig

CFG = ModelConfig.from_hf(TINY_CONFIG)

VERSIONS = {
    "v0": {"w": np.zeros((2, 3), np.float32)},
    "v1": {"w": np.ones((2, 3), np.float32)},
    "v2": {"w": np.full((2, 3), 2.0, np.float32)},
    "bad": {"w": np.ones((3, 3), np.float32)},
}


def source(version: str, verify: bool | None, expected: object = None) -> LoadedShard:
    if version not in VERSIONS:
        raise ControlError(404, f"unknown version {version!r}")
    arrays = {k: v.copy() for k, v in VERSIONS[version].items()}
    return LoadedShard(version, arrays, [], sum(a.nbytes for a in arrays.values()))


def value(store: WeightStore) -> float:
    assert store.current is not None
    return float(store.current["w"].numpy()[0, 0])


@pytest.fixture
def store() -> WeightStore:
    s = WeightStore(0, source)
    s.load_initial("v0")
    return s


def test_commit_then_finalize(store: WeightStore) -> None:
    store.stage("v1", False, "u1")
    assert value(store) == 0.0  # staged only
    store.commit("v1", "u1")
    assert (store.version, value(store)) == ("v1", 1.0)
    assert store._previous is not None
    store.finalize("u1")
    assert store._previous is None


def test_rollback_after_commit_restores_previous(store: WeightStore) -> None:
    store.stage("v1", False, "u1")
    store.commit("v1", "u1")
    assert store.rollback("u1") is True
    assert (store.version, value(store)) == ("v0", 0.0)


def test_late_commit_after_rollback_is_refused(store: WeightStore) -> None:
    store.stage("v1", False, "u1")
    assert store.rollback("u1") is False  # not committed yet: staging dropped
    with pytest.raises(ControlError) as e:
        store.commit("v1", "u1")
    assert e.value.code == 409 and (store.version, value(store)) == ("v0", 0.0)


def test_a_revoked_update_is_refused_before_its_rollback_runs(store: WeightStore) -> None:
    """``revoke`` (the rollback *arrived*; its own work not run yet) refuses the commit and
    changes nothing; another update's id is not affected."""
    store.stage("v1", False, "u1")
    store.revoke("u0")
    store.revoke("u1")
    with pytest.raises(ControlError) as e:
        store.commit("v1", "u1")
    assert e.value.code == 409 and "u1 was rolled back" in e.value.message
    assert (store.version, value(store)) == ("v0", 0.0) and store._staged is not None
    assert store.rollback("u1") is False and store._staged is None  # then it runs
    store.stage("v1", False, "u2")
    store.commit("v1", "u2")
    assert (store.version, value(store)) == ("v1", 1.0)


def test_commit_needs_matching_stage(store: WeightStore) -> None:
    store.stage("v1", False, "u1")
    with pytest.raises(ControlError):
        store.commit("v1", "other")
    with pytest.raises(ControlError):
        store.commit("v2", "u1")
    assert value(store) == 0.0


def test_bad_shape_never_reaches_current(store: WeightStore) -> None:
    with pytest.raises(ControlError) as e:
        store.stage("bad", False, "u1")
    assert e.value.code == 422 and "shape" in e.value.message
    assert value(store) == 0.0 and store._staged is None


def test_next_stage_finalizes_the_previous_update(store: WeightStore) -> None:
    store.stage("v1", False, "u1")
    store.commit("v1", "u1")  # finalize never arrived
    store.stage("v2", False, "u2")
    assert store._previous is None
    store.commit("v2", "u2")
    assert value(store) == 2.0


def test_free_releases_everything(store: WeightStore) -> None:
    store.stage("v1", False, "u1")
    store.commit("v1", "u1")
    store.stage("v2", False, "u2")
    store.free()
    assert store.current is None and store._staged is None and store._previous is None
    store.reload()
    assert value(store) == 1.0  # the current version (v1) comes back


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_half_precision_arrays_become_paddle_tensors_of_that_dtype(dtype: str) -> None:
    """What a rank holds when the compute dtype is the checkpoint's (GPU, ``auto``): bf16
    raw 2-byte data becomes a paddle bfloat16 tensor with the same values."""
    import paddle

    from services.worker.weights import to_paddle
    from shared import safetensors as st

    x = np.array([[1.0, -2.5], [3.140625, 65280.0]], np.float32)
    arr = st.convert(x, dtype)
    t = to_paddle({"w": arr})["w"]
    assert str(t.dtype).removeprefix("paddle.") == dtype
    np.testing.assert_array_equal(t.astype(paddle.float32).numpy(), x)


def test_a_refused_load_keeps_nothing_it_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load refused after its bytes were read (a wakeup whose files changed while
    asleep; a pre-sharded shard failing its SHA-256, read into one private buffer) held
    them in the frames of its traceback; an exception is often kept in a reference
    cycle (asyncio's executor futures) that only the GC breaks, so an asleep rank whose
    wakeup was refused kept a whole shard resident. Kept here on purpose, GC off: what
    was read must be gone anyway."""
    md = create_model_dir(tmp_path / "m", seed=0)
    write_sharded_dir(md / "versions" / "s1", CFG, sharding.init_weights(CFG, 1), 2, "m", "s1")
    snap = SnapshotSource(CFG, md, 0, 2)
    arrays: list[weakref.ref[np.ndarray]] = []
    buffers: list[weakref.ref[Any]] = []

    def recording(version: str, verify: bool | None, expected: object = None) -> LoadedShard:
        shard = snap(version, verify, expected)  # type: ignore[arg-type]
        arrays.extend(weakref.ref(a) for a in shard.arrays.values())
        return shard

    def read_file(*args: Any) -> Any:
        buf = real_read_file(*args)
        buffers.append(weakref.ref(buf))
        return buf

    real_read_file = hf_files.read_file
    monkeypatch.setattr(hf_files, "read_file", read_file)
    store = WeightStore(0, recording)
    store.load_initial("v0")
    store.free()
    arrays.clear()
    f = md / "model.safetensors"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1))  # changed: refused
    shard = md / "versions" / "s1" / "rank0-of-2.safetensors"
    data = bytearray(shard.read_bytes())
    data[-2] ^= 1
    shard.write_bytes(bytes(data))  # its SHA-256 no longer the manifest's
    kept = []
    gc.disable()
    try:
        with pytest.raises(ControlError) as e:
            store.reload()
        assert e.value.code == 422 and "changed since" in e.value.message
        kept.append(e.value)
        assert arrays and all(r() is None for r in arrays), "a refused wakeup kept its arrays"
        with pytest.raises(ControlError) as e:
            store.stage("s1", None, "u1")
        assert e.value.code == 422 and "SHA-256" in e.value.message
        kept.append(e.value)
        assert buffers and all(r() is None for r in buffers), "a refused shard kept its buffer"
    finally:
        gc.enable()
