"""Snapshot versions: verification default, forged sizes, relative names (real files)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from services.tiny_model import TINY_CONFIG, create_model_dir
from services.trainer.shards import write_sharded_dir
from services.worker.sources import open_confined
from services.worker.weights import SnapshotSource
from shared import manifest as mf
from shared import sharding
from shared.errors import ControlError
from shared.model_config import ModelConfig

CFG = ModelConfig.from_hf(TINY_CONFIG)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = create_model_dir(tmp_path / "m", TINY_CONFIG, seed=0)
    write_sharded_dir(d / "versions" / "s1", CFG, sharding.init_weights(CFG, 1), 2, "m", "s1")
    return d


def expected(model_dir: Path, rank: int) -> dict[str, mf.TensorSpec]:
    return (
        mf.decode((model_dir / "versions" / "s1" / "manifest.json").read_bytes())
        .shard(rank)
        .tensors
    )


def refused(
    model_dir: Path,
    rank: int,
    verify: bool | None = None,
    code: int = 422,
    exp: dict[str, mf.TensorSpec] | None = None,
) -> str:
    with pytest.raises(ControlError) as e:
        SnapshotSource(CFG, model_dir, rank, 2)("s1", verify, exp or expected(model_dir, rank))
    assert e.value.code == code, e.value.message
    assert str(model_dir) not in e.value.message
    return e.value.message


def test_presharded_verifies_by_default_and_names_relative_files(model_dir: Path) -> None:
    shard = SnapshotSource(CFG, model_dir, 1, 2)("s1", None, expected(model_dir, 1))
    assert shard.timings["verified"] is True
    assert shard.files == ["versions/s1/rank1-of-2.safetensors"]
    f = model_dir / "versions" / "s1" / "rank1-of-2.safetensors"
    data = bytearray(f.read_bytes())
    data[-2] ^= 1
    f.write_bytes(bytes(data))
    assert "SHA-256" in refused(model_dir, 1)
    shard = SnapshotSource(CFG, model_dir, 1, 2)("s1", False, expected(model_dir, 1))
    assert shard.timings["verified"] is False


def test_forged_manifest_size_is_refused(model_dir: Path) -> None:
    m = model_dir / "versions" / "s1" / "manifest.json"
    man = mf.decode(m.read_bytes())
    man.shards[0].size = 50_000_000_000
    m.write_bytes(mf.encode(man))
    msg = refused(model_dir, 0, False)
    assert "rank 0: versions/s1/rank0-of-2.safetensors" in msg and "does not fit" in msg


def test_shard_without_manifest_must_fit_the_served_tensors(model_dir: Path) -> None:
    d = model_dir / "versions" / "s1"
    exp = [expected(model_dir, r) for r in range(2)]
    (d / "manifest.json").unlink()
    SnapshotSource(CFG, model_dir, 1, 2)("s1", None, exp[1])  # fits: loads, unverified
    with open(d / "rank0-of-2.safetensors", "ab") as f:
        f.truncate(1 << 30)  # sparse: a 1 GiB file for a ~2 MB shard
    assert "does not fit" in refused(model_dir, 0, exp=exp[0])
    assert "manifest" in refused(model_dir, 1, True, code=400, exp=exp[1])


def test_hf_snapshot_without_manifest_loads_unverified(model_dir: Path) -> None:
    create_model_dir(model_dir / "versions" / "hf", TINY_CONFIG, seed=2)
    src = SnapshotSource(CFG, model_dir, 0, 2)
    shard = src("hf", None, None)
    assert shard.timings["verified"] is False and shard.files == ["versions/hf/model.safetensors"]
    with pytest.raises(ControlError) as e:
        src("hf", True, None)
    assert e.value.code == 400 and str(model_dir) not in e.value.message


def test_open_confined_takes_one_plain_component(tmp_path: Path) -> None:
    (tmp_path / "v").mkdir()
    (tmp_path / "x").write_bytes(b"1")
    fd = os.open(tmp_path / "v", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ("../x", "..", "a/b", ""):
            with pytest.raises(ControlError, match="not a plain name"):
                open_confined(name, fd, frozenset({os.geteuid()}), "w", False)
    finally:
        os.close(fd)


def test_a_dir_still_being_copied_is_not_there_yet_not_broken(model_dir: Path) -> None:
    """Mid-copy (a shard shorter than its manifest says, or not there yet) is a 404,
    which auto-update retries; before, a 422 that refused the version for good. A
    complete shard with wrong bytes or a wrong size is still a 422."""
    f = model_dir / "versions" / "s1" / "rank1-of-2.safetensors"
    full = f.read_bytes()
    with open(f, "r+b") as fh:
        fh.truncate(len(full) - 100)
    msg = refused(model_dir, 1, code=404)
    assert "not complete yet in versions/s1" in msg and "rank1-of-2.safetensors has" in msg
    f.unlink()
    assert "is not there yet" in refused(model_dir, 1, code=404)
    f.write_bytes(full + b"\0")
    assert "size" in refused(model_dir, 1)  # longer than the manifest: broken
    f.write_bytes(full)
    SnapshotSource(CFG, model_dir, 1, 2)("s1", None, expected(model_dir, 1))


def split_checkpoint(src: Path, dst: Path, parts: int) -> list[str]:
    """``src``'s model.safetensors as an HF sharded checkpoint of ``parts`` files
    (``model-0000k-of-0000n.safetensors``, tensors dealt round), no index."""
    import json
    import struct

    from shared.safetensors import encode_header

    raw = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    head.pop("__metadata__", None)
    data = raw[8 + n :]
    names = sorted(head)
    files = []
    dst.mkdir(parents=True)
    for k in range(parts):
        meta, blob = {}, b""
        for t in names[k::parts]:
            a, b = head[t]["data_offsets"]
            meta[t] = {**head[t], "data_offsets": [len(blob), len(blob) + b - a]}
            blob += data[a:b]
        name = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        (dst / name).write_bytes(encode_header(meta) + blob)
        files.append(name)
    return files


def test_an_hf_sharded_dir_missing_a_numbered_shard_is_not_there_yet(model_dir: Path) -> None:
    """``cp -r`` of an HF sharded checkpoint caught after ``model-00001-of-00002`` but
    before ``model-00002-of-00002`` and the index: the names say a shard is missing —
    a copy in progress (404), not a checkpoint that lacks tensors (422, which
    auto-update refuses for good)."""
    d = model_dir / "versions" / "s1"
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    files = split_checkpoint(model_dir, d, 2)
    second = (d / files[1]).read_bytes()
    (d / files[1]).unlink()
    with pytest.raises(ControlError) as e:
        SnapshotSource(CFG, model_dir, 0, 2)("s1", None, None)
    assert e.value.code == 404, e.value.message
    assert f"{files[1]} is not there yet" in e.value.message, e.value.message
    (d / files[1]).write_bytes(second)
    SnapshotSource(CFG, model_dir, 0, 2)("s1", None, None)
    SnapshotSource(CFG, model_dir, 1, 2)("s1", None, None)


def test_a_tensor_in_two_files_of_an_hf_dir_is_refused_not_picked(model_dir: Path) -> None:
    """Which copy of a tensor held by two files is served must not depend on file name
    order: a stale full ``model.safetensors`` beside a sharded set (no index), or a
    shard that also holds a tensor the index maps to another shard, was served from
    whichever file sorted first (the index ignored) — now 422 naming both files."""
    import json

    from safetensors.numpy import load_file, save_file

    d = model_dir / "versions" / "dup"
    files = split_checkpoint(model_dir, d, 2)
    full = load_file(str(model_dir / "model.safetensors"))
    stale = {k: v + 1 for k, v in full.items()}
    save_file(stale, str(d / "model.safetensors"))  # sorts after model-0000x: was ignored
    msg = refused_version(model_dir, "dup")
    assert "is also in versions/dup/model-0000" in msg and "model.safetensors" in msg, msg
    # with an index: shard 1 also holds shard 2's tensor `moved`, with other values
    (d / "model.safetensors").unlink()
    second = load_file(str(d / files[1]))
    moved = sorted(second)[0]
    weight_map = {k: files[0] for k in load_file(str(d / files[0]))}
    weight_map.update(dict.fromkeys(second, files[1]))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    SnapshotSource(CFG, model_dir, 0, 2)("dup", None, None)  # consistent: loads
    save_file({**load_file(str(d / files[0])), moved: stale[moved]}, str(d / files[0]))
    msg = refused_version(model_dir, "dup")
    assert f"{moved!r} is also in versions/dup/{files[0]}" in msg, msg


def refused_version(model_dir: Path, version: str) -> str:
    for rank in (0, 1):
        with pytest.raises(ControlError) as e:
            SnapshotSource(CFG, model_dir, rank, 2)(version, None, None)
        assert e.value.code == 422, e.value.message
        assert str(model_dir) not in e.value.message
    return e.value.message


@pytest.mark.parametrize("with_manifest", [True, False])
def test_a_presharded_model_dir_must_hold_the_configs_tensors(
    tmp_path: Path, with_manifest: bool
) -> None:
    """The initial load has no served spec yet (it makes it): a pre-sharded model dir
    whose shards are of another config (vocab 640 where config.json says 320) loaded
    unchecked, and its spec then refused every right version. Now checked against the
    config's shapes, as an HF dir's tensors are."""
    import json

    md = tmp_path / "m"
    md.mkdir()
    (md / "config.json").write_text(json.dumps(TINY_CONFIG))
    other = ModelConfig.from_hf({**TINY_CONFIG, "vocab_size": 640})
    for cfg, ok in ((other, False), (CFG, True)):
        write_sharded_dir(md, cfg, sharding.init_weights(cfg, 1), 2, "m", "v0")
        if not with_manifest:
            (md / "manifest.json").unlink()
        for rank in (0, 1):
            src = SnapshotSource(CFG, md, rank, 2)
            if ok:
                assert src("v0", None, None).arrays["lm_head.weight"].shape == (320, 128)
                continue
            with pytest.raises(ControlError) as e:
                src("v0", None, None)
            assert e.value.code == 422 and str(tmp_path) not in e.value.message
            assert "has shape [640, 128], expected [320, 128]" in e.value.message


def test_a_shard_cut_short_after_its_load_cannot_kill_the_rank(model_dir: Path) -> None:
    """A pre-sharded shard was mapped and its tensors kept as views of the mapping until
    the staging copy: the file cut short meanwhile (``cp`` over the version dir opens it
    with O_TRUNC) made that copy touch pages past its end — SIGBUS, the rank died. Now
    the shard is read into private memory (and hashed there: what is verified is what
    is served), so the file changing afterwards cannot reach the loaded tensors. Run in
    a child: the old code kills the process it runs in."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        import numpy as np
        from services.tiny_model import TINY_CONFIG
        from services.worker.weights import SnapshotSource
        from shared.model_config import ModelConfig
        md = Path({str(model_dir)!r})
        src = SnapshotSource(ModelConfig.from_hf(TINY_CONFIG), md, 0, 2)
        shard = src("s1", None, None)
        os.truncate(md / "versions" / "s1" / "rank0-of-2.safetensors", 0)
        print(sum(float(np.asarray(a, dtype=np.float64).sum()) for a in shard.arrays.values()))
        """
    )
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


def test_unverified_a_presharded_shard_written_while_read_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for ipc: with verify off nothing but the file's stat binds the bytes read, so
    a write during the read (placed by the seam just after it; the write is real) is a
    422, not a possibly mixed shard served under a stale pin."""
    from services.worker import hf_files

    shard = model_dir / "versions" / "s1" / "rank0-of-2.safetensors"

    def read_file(*args: object) -> object:
        buf = real_read_file(*args)  # type: ignore[arg-type]
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1))
        return buf

    real_read_file = hf_files.read_file
    monkeypatch.setattr(hf_files, "read_file", read_file)
    msg = refused(model_dir, 0, verify=False)
    assert "changed while read" in msg, msg


@pytest.mark.parametrize("how", ["dir_swapped", "file_renamed_over"])
def test_unverified_a_presharded_shard_replaced_around_its_read(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The shard's stat and its read must be of one open file. They were of the path,
    stat'ed, then opened again by the read, then stat'ed again: a version dir swapped
    for another (renamed away, the other renamed in) just before the read and swapped
    back after it had the other dir's bytes read under the first file's stat, and the
    stat after the read (of the first file again, untouched: a dir rename changes only
    the dir) agreed: other bytes served under the pin of these, silently. Now the file
    stat'ed is the file read: the bytes of the pinned file are served. A shard renamed
    over while read unlinks the file read (its link count and ctime change): 422, as
    before. The renames are real; the seam only places them around the read."""
    from safetensors.numpy import load_file

    from services.worker import hf_files
    from services.worker.weights import stat_pin

    d = model_dir / "versions" / "s1"
    exp = expected(model_dir, 0)
    (d / "manifest.json").unlink()  # nothing but the stat binds the bytes
    shard = d / "rank0-of-2.safetensors"
    want = load_file(str(shard))
    pinned = shard.stat()
    other = bytearray(shard.read_bytes())
    other[-2] ^= 1  # the same size, another value in the last tensor
    d2, away = model_dir / "versions" / "s1-other", model_dir / "versions" / "away"
    d2.mkdir()
    (d2 / shard.name).write_bytes(bytes(other))

    def read_file(*args: object) -> object:
        if how == "file_renamed_over":
            os.rename(d2 / shard.name, shard)
            return real_read_file(*args)  # type: ignore[arg-type]
        os.rename(d, away)
        os.rename(d2, d)
        try:
            return real_read_file(*args)  # type: ignore[arg-type]
        finally:
            os.rename(d, d2)
            os.rename(away, d)

    real_read_file = hf_files.read_file
    monkeypatch.setattr(hf_files, "read_file", read_file)
    src = SnapshotSource(CFG, model_dir, 0, 2)
    if how == "file_renamed_over":
        msg = refused(model_dir, 0, exp=exp)
        assert "rank 0: versions/s1/rank0-of-2.safetensors: changed while read" in msg, msg
        return
    got = src("s1", None, exp)
    assert got.pin == {"versions/s1/rank0-of-2.safetensors": stat_pin(pinned)}
    for name, a in want.items():
        np.testing.assert_array_equal(got.arrays[name], a, err_msg=name)


@pytest.mark.parametrize("parts", [1, 2])
def test_an_hf_file_written_while_read_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, parts: int
) -> None:
    """An HF checkpoint (one ``model.safetensors`` or a sharded set) has no manifest,
    so nothing but each file's stat binds the bytes a rank read from it: a write in
    place between two of its tensors' reads was served, mixed old and new bytes under
    the stat taken before it (refused only at the next wakeup). The stat after the
    read must be the one before it: 422 naming the file, as for a pre-sharded shard.
    The write is real (a value in the file's last tensor); the seam only places it
    after the first tensor read."""
    import shutil

    from services.worker import hf_files

    d = model_dir / "versions" / "hf"
    if parts == 1:
        d.mkdir(parents=True)
        shutil.copy(model_dir / "model.safetensors", d)
        files = ["model.safetensors"]
    else:
        files = split_checkpoint(model_dir, d, parts)
    src = SnapshotSource(CFG, model_dir, 0, 2)
    src("hf", None, None)  # untouched: loads
    target = d / files[-1]
    written: list[str] = []

    def read_part(fd: int, *args: object) -> object:
        if not written and os.path.samefile(f"/proc/self/fd/{fd}", target):
            written.append(target.name)
            with open(target, "r+b") as f:
                f.seek(-2, os.SEEK_END)
                b = f.read(1)
                f.seek(-2, os.SEEK_END)
                f.write(bytes([b[0] ^ 1]))
        return real_read_part(fd, *args)  # type: ignore[arg-type]

    real_read_part = hf_files.read_part
    monkeypatch.setattr(hf_files, "read_part", read_part)
    with pytest.raises(ControlError) as e:
        src("hf", None, None)
    assert written == [files[-1]]
    assert e.value.code == 422 and str(model_dir) not in e.value.message
    assert e.value.message.startswith(f"rank 0: versions/hf/{files[-1]}: "), e.value.message
    assert "changed while read" in e.value.message, e.value.message
    monkeypatch.setattr(hf_files, "read_part", real_read_part)
    src("hf", None, None)  # its new bytes, read whole: loads


def test_an_hf_dir_swapped_around_its_read_serves_the_files_pinned(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a pre-sharded shard: an HF file's stat (its pin) and its read must be of
    one open file. The pin was the path's stat and the read opened the path again, so a
    version dir swapped for another (same names and sizes, other values) just before
    the read and back after it had the other dir's tensors served under these files'
    pins. Now the files pinned are the files read. The renames are real; the seam only
    places them around each file's read."""
    import shutil

    from services.worker import hf_files

    d = model_dir / "versions" / "hf"
    files = split_checkpoint(model_dir, d, 2)
    src = SnapshotSource(CFG, model_dir, 0, 2)
    want = src("hf", None, None)
    d2, away = model_dir / "versions" / "hf-other", model_dir / "versions" / "away"
    shutil.copytree(d, d2)
    for name in files:  # the same header, every byte of its last tensor's data flipped
        raw = bytearray((d2 / name).read_bytes())
        raw[-8:] = bytes(b ^ 0xFF for b in raw[-8:])
        (d2 / name).write_bytes(bytes(raw))

    def read_slices(*args: object, **kw: object) -> object:
        os.rename(d, away)
        os.rename(d2, d)
        try:
            return real_read_slices(*args, **kw)  # type: ignore[arg-type]
        finally:
            os.rename(d, d2)
            os.rename(away, d)

    real_read_slices = hf_files.read_slices
    monkeypatch.setattr(hf_files, "read_slices", read_slices)
    got = src("hf", None, None)
    assert got.pin == want.pin
    for name, a in want.arrays.items():
        np.testing.assert_array_equal(got.arrays[name], a, err_msg=name)
