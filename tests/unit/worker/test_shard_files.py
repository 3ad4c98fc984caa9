"""What a rank is given to read as a weight file, on real files: a FIFO, a directory or a
device named like one is refused at once (never waited on: a start must not hang), and
no refused load leaves a descriptor or its buffer behind."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import pytest

from services.tiny_model import TINY_CONFIG, create_model_dir
from services.trainer.publisher import CheckpointPublisher
from services.trainer.shards import write_sharded_dir
from services.worker import hf_files
from services.worker.sources import IpcSource
from services.worker.weights import SnapshotSource, WeightStore
from shared import manifest as mf
from shared import safetensors as st
from shared import sharding
from shared.errors import ControlError
from shared.model_config import ModelConfig
from shared.presence import snapshot_pending
from shared.settings import Settings
from shared.versions import ipc_version_dir

CFG = ModelConfig.from_hf(TINY_CONFIG)
MODEL = "tiny-files"
KINDS = ["fifo", "directory", "device"]


def special(path: Path, kind: str) -> Path:
    """A weight file's name given to something that is no regular file."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/null")  # a character device
    return path


def promptly(fn: Callable[[], Any], fifos: list[Path], timeout: float = 10.0) -> Any:
    """``fn()``; a test failure, not a hung test, when it blocks on one of ``fifos``
    (a writer opened on each lets the blocked open return)."""
    ex = ThreadPoolExecutor(1)
    fut = ex.submit(fn)
    try:
        return fut.result(timeout)
    except FutureTimeout:
        for _ in range(100):
            for f in fifos:
                try:
                    os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
            try:
                fut.result(0.1)
            except BaseException:  # noqa: BLE001 - only waiting for it to end
                pass
            if fut.done():
                break
        pytest.fail(f"blocked on a FIFO for {timeout:g}s (a start would hang)")
    finally:
        ex.shutdown(wait=False)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def refusal(fn: Callable[[], Any], fifos: list[Path], code: int = 422) -> str:
    """The 422 of ``fn()``: prompt, naming no absolute path, leaving no descriptor open."""
    before = open_fds()
    with pytest.raises(ControlError) as e:
        promptly(fn, fifos)
    assert open_fds() == before, "a refused load left a descriptor open"
    assert e.value.code == code, e.value.message
    assert "/tmp" not in e.value.message and "/dev" not in e.value.message, e.value.message
    return e.value.message


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = create_model_dir(tmp_path / "m", TINY_CONFIG, seed=0)
    write_sharded_dir(d / "versions" / "s1", CFG, sharding.init_weights(CFG, 1), 2, "m", "s1")
    return d


def expected(model_dir: Path, rank: int = 0) -> dict[str, mf.TensorSpec]:
    man = mf.decode((model_dir / "versions" / "s1" / "manifest.json").read_bytes())
    return man.shard(rank).tensors


@pytest.mark.parametrize("kind", KINDS)
def test_the_checkpoint_dtype_never_waits_on_a_fifo(model_dir: Path, kind: str) -> None:
    """A rank's start asks every ``*.safetensors`` of the model dir for its dtype: a FIFO
    among them blocked that start in the open (waiting for a writer), for good. It is
    skipped there (its load refuses it, below)."""
    fifo = special(model_dir / "extra.safetensors", kind)
    files = sorted(model_dir.glob("*.safetensors"))
    assert promptly(lambda: st.checkpoint_dtype(files), [fifo]) == "float32"
    with pytest.raises(ValueError, match="not a regular file"):
        promptly(lambda: st.read_header(fifo), [fifo])


@pytest.mark.parametrize("kind", KINDS)
def test_the_initial_load_refuses_a_weight_file_that_is_no_regular_file(
    model_dir: Path, kind: str
) -> None:
    """The model dir's own version (a start) with a FIFO / directory / device named
    ``*.safetensors`` beside its weights: a 422 naming the file, at once."""
    f = special(model_dir / "extra.safetensors", kind)
    src = SnapshotSource(CFG, model_dir, 0, 2)
    msg = refusal(lambda: src("v0", None, None), [f])
    assert msg.startswith("rank 0: extra.safetensors: ") and "not a regular file" in msg, msg


def snapshot_refuses(
    model_dir: Path, f: Path, version: str, verify: bool | None, spec: Any
) -> None:
    """``f`` (in ``versions/<version>``) never waited on by the pending check (not ready:
    None), and the version's load refused at once (422) naming it as no regular file."""
    d = f.parent
    assert promptly(lambda: snapshot_pending(d, 2, [0]), [f]) is None
    src = SnapshotSource(CFG, model_dir, 0, 2)
    msg = refusal(lambda: src(version, verify, spec), [f])
    assert msg.startswith(f"rank 0: versions/{version}/{f.name}: "), msg
    assert "not a regular file" in msg, msg


@pytest.mark.parametrize("kind", KINDS)
def test_an_hf_version_whose_file_is_no_regular_file_is_refused(model_dir: Path, kind: str) -> None:
    """Not "not there yet" (404, retried for ever: a FIFO never fills) and never a wait:
    broken, 422 naming the file."""
    d = model_dir / "versions" / "hf"
    d.mkdir()
    snapshot_refuses(model_dir, special(d / "model.safetensors", kind), "hf", None, None)


@pytest.mark.parametrize("kind", KINDS)
def test_an_hf_index_that_is_no_regular_file_is_never_waited_on(model_dir: Path, kind: str) -> None:
    d = model_dir / "versions" / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    f = special(d / st.INDEX_FILE, kind)
    promptly(lambda: snapshot_pending(d, 2, [0]), [f])


@pytest.mark.parametrize("manifest", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_a_presharded_shard_that_is_no_regular_file_is_refused(
    model_dir: Path, kind: str, manifest: bool
) -> None:
    d = model_dir / "versions" / "s1"
    exp = expected(model_dir)
    if not manifest:
        (d / "manifest.json").unlink()
    snapshot_refuses(model_dir, special(d / "rank0-of-2.safetensors", kind), "s1", False, exp)


# -- ipc: the trust rules already refuse what is no regular file (kept so)


@pytest.fixture
def ipc(tmp_path: Path) -> tuple[Path, mf.Manifest]:
    pub = CheckpointPublisher("nats://unused", ipc_dir=tmp_path / "ipc")
    blobs, man = pub.prepare(MODEL, "s1", sharding.init_weights(CFG, 3), 2, TINY_CONFIG)
    assert pub._write_ipc(MODEL, "s1", blobs, man, None) is True
    return tmp_path / "ipc", man


def ipc_source(ipc_dir: Path) -> IpcSource:
    s = Settings(model="/nonexistent", model_name=MODEL, tp=2, ipc_dir=ipc_dir)
    return IpcSource(s, None, 0, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", KINDS)
def test_an_ipc_shard_that_is_no_regular_file_is_refused(
    ipc: tuple[Path, mf.Manifest], kind: str
) -> None:
    ipc_dir, man = ipc
    f = special(ipc_version_dir(ipc_dir, MODEL, "s1") / "rank0-of-2.safetensors", kind)
    src = ipc_source(ipc_dir)
    msg = refusal(lambda: src("s1", None, man.shards[0].tensors), [f])
    assert "rank 0: ipc " in msg and ("not a regular file" in msg or "symlink" in msg), msg


# -- every refusal: no descriptor left open, its buffer released at once


def flip_last(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[-2] ^= 1
    f.write_bytes(bytes(raw))


def rewrite_during_read(monkeypatch: pytest.MonkeyPatch, f: Path) -> None:
    """A write in place during the read (the stat after it differs)."""
    real = hf_files.read_file

    def read_file(*args: Any) -> Any:
        buf = real(*args)
        fd = os.open(f, os.O_RDWR)
        try:
            os.pwrite(fd, os.pread(fd, 1, 0), 0)
        finally:
            os.close(fd)
        return buf

    monkeypatch.setattr(hf_files, "read_file", read_file)


DAMAGES = ["size", "sha256", "changed_while_read"]  # refused by the snapshot and IPC loads


def damage(monkeypatch: pytest.MonkeyPatch, shard: Path, how: str) -> bool | None:
    """``shard`` damaged as ``how`` (one of :data:`DAMAGES`) says: a byte more, a byte
    flipped, or rewritten during the read. The ``verify`` to stage it with: False for the
    rewrite, which the stat after the read catches (no hash checked)."""
    if how == "size":
        with open(shard, "ab") as fh:
            fh.write(b"x")
    elif how == "sha256":
        flip_last(shard)
    elif how == "changed_while_read":
        rewrite_during_read(monkeypatch, shard)
        return False
    else:
        raise ValueError(how)
    return None


def bad_header(src: Path, dst: Path) -> None:
    """``dst``: ``src`` with a header that is no JSON (the right size)."""
    raw = bytearray(src.read_bytes())
    raw[8:16] = b"\xff" * 8
    dst.write_bytes(bytes(raw))


SNAPSHOT_REFUSALS = ["size", "sha256", "changed_while_read", "bad_header", "hf_bad_header"]


@pytest.mark.parametrize("how", SNAPSHOT_REFUSALS)
def test_a_refused_snapshot_load_keeps_no_descriptor_nor_buffer(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    d = model_dir / "versions" / "s1"
    exp = expected(model_dir)
    shard = d / "rank0-of-2.safetensors"
    version, verify = "s1", None
    if how in DAMAGES:
        verify = damage(monkeypatch, shard, how)
    elif how == "bad_header":
        (d / "manifest.json").unlink()
        bad_header(shard, shard)
    else:
        version = "hf"
        (model_dir / "versions" / "hf").mkdir()
        bad_header(model_dir / "model.safetensors", model_dir / "versions/hf/model.safetensors")
    store = WeightStore(0, SnapshotSource(CFG, model_dir, 0, 2))
    store.spec = exp
    released(monkeypatch, lambda: store.stage(version, verify, "u1"))


def released(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], Any]) -> None:
    """``fn`` refused (422) with no descriptor left open and every buffer it read
    released by the refusal itself (the GC off: not when it runs)."""
    bufs: list[weakref.ref[Any]] = []
    real = hf_files.read_file

    def read_file(*args: Any) -> Any:
        buf = real(*args)
        bufs.append(weakref.ref(buf))
        return buf

    monkeypatch.setattr(hf_files, "read_file", read_file)
    gc.collect()
    gc.disable()
    try:
        before = open_fds()
        with pytest.raises(ControlError) as e:
            fn()
        assert e.value.code == 422, e.value.message
        assert open_fds() == before, e.value.message
        del e
        assert all(r() is None or r().closed for r in bufs), "a refused load kept its buffer"
    finally:
        gc.enable()


IPC_REFUSALS = ["size", "sha256", "changed_while_read", "symlink", "bad_header"]


@pytest.mark.parametrize("how", IPC_REFUSALS)
def test_a_refused_ipc_load_keeps_no_descriptor_nor_buffer(
    ipc: tuple[Path, mf.Manifest], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    ipc_dir, man = ipc
    shard = ipc_version_dir(ipc_dir, MODEL, "s1") / "rank0-of-2.safetensors"
    verify: bool | None = None
    if how in DAMAGES:
        verify = damage(monkeypatch, shard, how)
    elif how == "symlink":
        target = tmp_path / "elsewhere.safetensors"
        target.write_bytes(shard.read_bytes())
        shard.unlink()
        shard.symlink_to(target)
    else:
        verify = False
        bad_header(shard, shard)
    store = WeightStore(0, ipc_source(ipc_dir))
    store.spec = man.shards[0].tensors
    released(monkeypatch, lambda: store.stage("s1", verify, "u1"))


def test_an_unreadable_hf_file_is_named_once(model_dir: Path) -> None:
    """The parser's message names the file itself: the load's prefix is not said twice
    (it read ``rank 0: versions/hf/m.safetensors: cannot read: rank 0: versions/hf/...``)."""
    d = model_dir / "versions" / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\xff" * 16)
    src = SnapshotSource(CFG, model_dir, 0, 2)
    msg = refusal(lambda: src("hf", None, None), [])
    assert msg.startswith("rank 0: versions/hf/model.safetensors: cannot read: "), msg
    assert msg.count("rank 0") == 1, msg


def test_an_hf_index_naming_an_absolute_path_is_refused_without_echoing_it(
    model_dir: Path,
) -> None:
    """An index entry ``/abs/dir/model.safetensors`` was quoted whole in the 422 (the
    one way an absolute path of the host reached a reply); ``../x`` is still quoted."""
    import json

    d = model_dir / "versions" / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    for target, shown in [
        (str(model_dir / "model.safetensors"), "an absolute path to 'model.safetensors'"),
        ("../model.safetensors", "'../model.safetensors'"),
    ]:
        (d / st.INDEX_FILE).write_text(json.dumps({"weight_map": {"a": target}}))
        src = SnapshotSource(CFG, model_dir, 0, 2)
        msg = refusal(lambda: src("hf", None, None), [])  # noqa: B023 - called at once
        want = f"rank 0: versions/hf/{st.INDEX_FILE}: {shown} is not a file name inside"
        assert msg.startswith(want), msg
