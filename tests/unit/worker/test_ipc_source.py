"""The ipc load strategy's trust rules and the trainer's ipc writing, on real files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from services.tiny_model import TINY_CONFIG
from services.trainer.publisher import CheckpointPublisher, UnsafeIpcDir
from services.worker.sources import IpcSource
from shared import manifest as mf
from shared import sharding
from shared.errors import ControlError
from shared.model_config import ModelConfig
from shared.settings import Settings
from shared.versions import check_version_name, ipc_version_dir

MODEL = "tiny-ipc"
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def ipc(tmp_path: Path) -> tuple[Path, mf.Manifest]:
    """Version s1 written by the trainer SDK under tmp/ipc."""
    pub = CheckpointPublisher("nats://unused", ipc_dir=tmp_path / "ipc")
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    blobs, man = pub.prepare(MODEL, "s1", sharding.init_weights(cfg, 3), 2, TINY_CONFIG)
    assert pub._write_ipc(MODEL, "s1", blobs, man, None) is True
    return tmp_path / "ipc", man


def source(ipc_dir: Path, rank: int = 0, **kw: object) -> IpcSource:
    s = Settings(model="/nonexistent", model_name=MODEL, tp=2, ipc_dir=ipc_dir, **kw)
    return IpcSource(s, None, rank, 2)  # type: ignore[arg-type]


def load(
    ipc_dir: Path, man: mf.Manifest, rank: int = 0, verify: bool | None = None, **kw: object
) -> object:
    return source(ipc_dir, rank, **kw)("s1", verify, man.shards[rank].tensors)


def refused(ipc_dir: Path, man: mf.Manifest, rank: int = 0, **kw: object) -> str:
    with pytest.raises(ControlError) as e:
        load(ipc_dir, man, rank, **kw)
    assert e.value.code == 422, e.value.message
    assert f"rank {rank}" in e.value.message
    assert str(ipc_dir) not in e.value.message  # never the absolute path
    return e.value.message


def test_trainer_writes_0700_dirs_0600_files_through_a_temp_dir(
    ipc: tuple[Path, mf.Manifest],
) -> None:
    ipc_dir, man = ipc
    d = ipc_version_dir(ipc_dir, MODEL, "s1")
    for p in (ipc_dir, d.parent, d):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700, p
    for f in d.iterdir():
        assert stat.S_IMODE(os.lstat(f).st_mode) == 0o600, f
    assert sorted(p.name for p in d.parent.iterdir()) == ["s1"]  # no temp dir left


def test_default_load_verifies_and_names_no_absolute_path(ipc: tuple[Path, mf.Manifest]) -> None:
    ipc_dir, man = ipc
    shard = load(ipc_dir, man, 1)
    assert shard.timings["verified"] is True  # type: ignore[attr-defined]
    assert shard.files == [f"ipc {MODEL}/s1/rank1-of-2.safetensors"]  # type: ignore[attr-defined]


def test_corrupt_bytes_refused_by_default_served_only_when_verify_is_off(
    ipc: tuple[Path, mf.Manifest],
) -> None:
    ipc_dir, man = ipc
    f = ipc_version_dir(ipc_dir, MODEL, "s1") / "rank0-of-2.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's bytes: the header stays valid
    f.write_bytes(bytes(data))
    assert "SHA-256" in refused(ipc_dir, man, 0)
    assert "SHA-256" in refused(ipc_dir, man, 0, verify=True)
    assert load(ipc_dir, man, 0, verify=False).timings["verified"] is False  # type: ignore[attr-defined]


def test_symlinked_shard_is_refused(ipc: tuple[Path, mf.Manifest], tmp_path: Path) -> None:
    ipc_dir, man = ipc
    f = ipc_version_dir(ipc_dir, MODEL, "s1") / "rank1-of-2.safetensors"
    other = tmp_path / "elsewhere.safetensors"
    other.write_bytes(f.read_bytes())  # identical bytes: only the link is wrong
    f.unlink()
    f.symlink_to(other)
    msg = refused(ipc_dir, man, 1)
    assert "rank1-of-2.safetensors" in msg and "symlink" in msg


def test_hardlinked_shard_is_refused(ipc: tuple[Path, mf.Manifest], tmp_path: Path) -> None:
    """Same bytes, same owner, but a second name outside the version dir: whoever can
    write there changes the served weights after the check."""
    ipc_dir, man = ipc
    f = ipc_version_dir(ipc_dir, MODEL, "s1") / "rank0-of-2.safetensors"
    os.link(f, tmp_path / "outside.safetensors")
    msg = refused(ipc_dir, man, 0)
    assert "rank0-of-2.safetensors" in msg and "hard link" in msg, msg
    (tmp_path / "outside.safetensors").unlink()
    assert load(ipc_dir, man, 0) is not None


def test_symlinked_version_dir_is_refused(ipc: tuple[Path, mf.Manifest], tmp_path: Path) -> None:
    ipc_dir, man = ipc
    d = ipc_version_dir(ipc_dir, MODEL, "s1")
    moved = tmp_path / "moved"
    d.rename(moved)
    d.symlink_to(moved)
    assert "symlink" in refused(ipc_dir, man, 0)


@root_only
def test_foreign_owner_is_refused_unless_it_is_the_trainer_uid(
    ipc: tuple[Path, mf.Manifest],
) -> None:
    ipc_dir, man = ipc
    f = ipc_version_dir(ipc_dir, MODEL, "s1") / "rank0-of-2.safetensors"
    os.chown(f, NOBODY, NOBODY)
    msg = refused(ipc_dir, man, 0)
    assert "rank0-of-2.safetensors" in msg and f"uid {NOBODY}" in msg
    assert load(ipc_dir, man, 0, ipc_trainer_uid=NOBODY) is not None


@root_only
def test_world_writable_ipc_dir_not_ours_is_refused(ipc: tuple[Path, mf.Manifest]) -> None:
    ipc_dir, man = ipc
    os.chown(ipc_dir, NOBODY, NOBODY)
    assert "ipc dir" in refused(ipc_dir, man, 0)
    os.chown(ipc_dir, os.geteuid(), os.getegid())
    os.chmod(ipc_dir, 0o777)
    assert "writable by others" in refused(ipc_dir, man, 0)


def test_writable_shard_is_refused(ipc: tuple[Path, mf.Manifest]) -> None:
    ipc_dir, man = ipc
    os.chmod(ipc_version_dir(ipc_dir, MODEL, "s1") / "rank1-of-2.safetensors", 0o666)
    assert "writable by others" in refused(ipc_dir, man, 1)


def test_manifest_paths_cannot_leave_the_version_dir(
    ipc: tuple[Path, mf.Manifest], tmp_path: Path
) -> None:
    ipc_dir, man = ipc
    d = ipc_version_dir(ipc_dir, MODEL, "s1")
    (d.parent / "evil").mkdir(mode=0o700)
    (d.parent / "evil" / "x.safetensors").write_bytes((d / "rank0-of-2.safetensors").read_bytes())
    os.chmod(d / "manifest.json", 0o600)
    bad = mf.decode((d / "manifest.json").read_bytes())
    bad.shards[0].file = "../evil/x.safetensors"
    (d / "manifest.json").write_bytes(mf.encode(bad))
    assert "not a plain file name" in refused(ipc_dir, man, 0)


def test_forged_manifest_size_is_refused_before_mapping(ipc: tuple[Path, mf.Manifest]) -> None:
    ipc_dir, man = ipc
    d = ipc_version_dir(ipc_dir, MODEL, "s1")
    bad = mf.decode((d / "manifest.json").read_bytes())
    bad.shards[1].size = 50_000_000_000
    (d / "manifest.json").write_bytes(mf.encode(bad))
    msg = refused(ipc_dir, man, 1)
    assert "rank1-of-2.safetensors" in msg and "50000000000" in msg and "does not fit" in msg


def test_trainer_refuses_unsafe_ipc_dirs(tmp_path: Path) -> None:
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    for ipc_dir in (tmp_path / "link",):
        pub = CheckpointPublisher("nats://unused", ipc_dir=ipc_dir)
        blobs, man = pub.prepare(MODEL, "s1", sharding.init_weights(cfg, 3), 2, TINY_CONFIG)
        with pytest.raises(UnsafeIpcDir, match="symlink"):
            pub._write_ipc(MODEL, "s1", blobs, man, None)
    os.chmod(real, 0o777)
    pub = CheckpointPublisher("nats://unused", ipc_dir=real)
    with pytest.raises(UnsafeIpcDir, match="world-writable"):
        pub._write_ipc(MODEL, "s1", blobs, man, None)
    assert not list(real.iterdir())


def test_missing_shard_of_a_listed_version_is_422_and_unknown_version_404(
    ipc: tuple[Path, mf.Manifest],
) -> None:
    ipc_dir, man = ipc
    (ipc_version_dir(ipc_dir, MODEL, "s1") / "rank1-of-2.safetensors").unlink()
    assert "missing" in refused(ipc_dir, man, 1)
    with pytest.raises(ControlError) as e:
        source(ipc_dir)("nope", None, None)
    assert e.value.code == 404 and str(ipc_dir) not in e.value.message


@pytest.mark.parametrize("version", ["y" * 256, "ü" * 60])
def test_a_long_valid_version_goes_through_ipc(tmp_path: Path, version: str) -> None:
    """A valid version whose quoted name is over NAME_MAX (256 characters; 60 non-ASCII,
    quoted three bytes each to six characters): before, the SDK failed with ``File name
    too long`` (blamed on ROLLBUS_IPC_DIR) and no rank could find it."""
    pub = CheckpointPublisher("nats://unused", ipc_dir=tmp_path / "ipc")
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    blobs, man = pub.prepare(MODEL, version, sharding.init_weights(cfg, 3), 2, TINY_CONFIG)
    assert pub._write_ipc(MODEL, version, blobs, man, None) is True
    d = ipc_version_dir(tmp_path / "ipc", MODEL, version)
    assert d.is_dir() and len(d.name) <= 200
    shard = source(tmp_path / "ipc", 1)(version, None, man.shards[1].tensors)
    assert shard.timings["verified"] is True  # type: ignore[attr-defined]
    # another long version with the same first characters is another directory
    assert ipc_version_dir(tmp_path, MODEL, version + "z") != d


def test_a_short_version_never_takes_a_long_ones_ipc_dir(tmp_path: Path) -> None:
    """A long version's directory is its first characters, ``~`` and a hash: a valid
    short version spelled exactly so (``~`` is a legal character) must still get a
    directory of its own, not the long one's (a rank would load the other's files)."""
    long = "y" * 256
    short = ipc_version_dir(tmp_path, MODEL, long).name  # 193 characters: a valid version
    assert check_version_name(short) == short
    assert ipc_version_dir(tmp_path, MODEL, short) != ipc_version_dir(tmp_path, MODEL, long)


def test_a_shard_cut_short_during_the_load_cannot_kill_the_rank(
    ipc: tuple[Path, mf.Manifest],
) -> None:
    """The trainer rewriting or cleaning its ipc dir (``O_TRUNC``) while a rank loads
    the shard: it used to be mapped, and the next touch of a page past the new end (the
    parse, the staging copy) was SIGBUS — the rank process died. Now it is read once
    into private memory: cut short before the read, a 422 naming the rank and file; cut
    short after it, the bytes read (and hashed) are served. The truncate is real; the
    seams only place it: right after the size check's ``os.fstat``, or just before the
    tensors are parsed. Run in a child, since the old code kills the process it runs in."""
    import subprocess
    import sys
    import textwrap

    ipc_dir, man = ipc
    code = textwrap.dedent(
        f"""
        import os, sys
        import numpy as np
        from pathlib import Path
        from services.worker import hf_files, sources
        from shared import manifest as mf
        from shared import safetensors as st
        from shared.errors import ControlError
        from shared.settings import Settings
        from shared.versions import ipc_version_dir

        ipc_dir = Path({str(ipc_dir)!r})
        shard = ipc_version_dir(ipc_dir, {MODEL!r}, "s1") / "rank0-of-2.safetensors"
        original = shard.read_bytes()
        want = {{k: v.copy() for k, v in st.load(original, "orig").items()}}
        man = mf.decode((shard.parent / "manifest.json").read_bytes())
        real_fstat, real_load_buffer = os.fstat, hf_files.load_buffer

        def cut():
            os.truncate(shard, len(original) // 2)  # as O_TRUNC before a rewrite

        def fstat(fd):
            st = real_fstat(fd)
            # the fstat the size check and pin use (not the trust check's in open_confined)
            if sys._getframe(1).f_code.co_name == "bound_to_file" and os.readlink(
                f"/proc/self/fd/{{fd}}"
            ) == str(shard):
                cut()
            return st

        def load_buffer(*args, **kw):
            cut()
            return real_load_buffer(*args, **kw)

        s = Settings(model="/nonexistent", model_name={MODEL!r}, tp=2, ipc_dir=ipc_dir)
        src = sources.IpcSource(s, None, 0, 2)
        for when in ("before_parse", "after_size_check"):
            for verify in (None, False):
                shard.write_bytes(original)  # whole again, same inode
                if when == "before_parse":
                    hf_files.load_buffer = load_buffer
                else:
                    sources.os.fstat = fstat
                try:
                    got = src("s1", verify, man.shards[0].tensors)
                except ControlError as e:
                    print(when, "refused", e.code, e.message, flush=True)
                    continue
                finally:
                    sources.os.fstat, hf_files.load_buffer = real_fstat, real_load_buffer
                # every byte touched, as the staging copy does
                same = all(np.array_equal(got.arrays[k], want[k]) for k in want)
                print(when, "served", "original" if same else "other bytes", flush=True)
        """
    )
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert lines[:2] == ["before_parse served original"] * 2, lines
    assert len(lines) == 4, lines
    for line in lines[2:]:
        prefix = f"after_size_check refused 422 rank 0: ipc {MODEL}/s1/rank0-of-2.safetensors: "
        assert line.startswith(prefix), line
        assert "changed while read" in line and str(ipc_dir) not in line, line


def test_the_served_bytes_are_the_hashed_bytes(
    ipc: tuple[Path, mf.Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hash and the parse read the shard once, in the rank's own memory: bytes the
    trainer writes in place after the hash (the old mapping showed them to the staging
    copy, never hashed) or after the load are not served. The seam only places the
    real in-place write between the hash and the parse. And the tensors are writable and
    C-contiguous, so ``to_paddle`` takes them over without another copy."""
    import numpy as np

    from services.worker import hf_files
    from shared import safetensors as st

    ipc_dir, man = ipc
    shard = ipc_version_dir(ipc_dir, MODEL, "s1") / "rank0-of-2.safetensors"
    original = shard.read_bytes()
    hashed = {k: v.copy() for k, v in st.load(original, "orig").items()}
    data_start = 8 + int.from_bytes(original[:8], "little")

    def scribble() -> None:  # every data byte flipped, in place: same inode, same size
        flipped = np.frombuffer(original, np.uint8, offset=data_start) ^ np.uint8(0xFF)
        fd = os.open(shard, os.O_WRONLY)
        try:
            os.pwrite(fd, flipped.tobytes(), data_start)
        finally:
            os.close(fd)

    def load_buffer(*args: object, **kw: object) -> object:
        scribble()  # after the SHA-256 check, before the tensors are parsed
        return real_load_buffer(*args, **kw)

    real_load_buffer = hf_files.load_buffer
    monkeypatch.setattr(hf_files, "load_buffer", load_buffer)
    got = load(ipc_dir, man, 0)
    assert got.timings["verified"] is True  # type: ignore[attr-defined]
    assert shard.read_bytes() != original  # the file did change under the load
    arrays = got.arrays  # type: ignore[attr-defined]
    assert sorted(arrays) == sorted(hashed)
    for name, a in arrays.items():
        np.testing.assert_array_equal(a, hashed[name], err_msg=name)
        assert a.flags.writeable and a.flags.c_contiguous, name
    shard.write_bytes(original)
    scribble()  # after the load too
    for name, a in arrays.items():
        np.testing.assert_array_equal(a, hashed[name], err_msg=name)


@pytest.mark.parametrize("when", ["before", "after"])
def test_unverified_a_shard_written_while_read_is_refused(
    ipc: tuple[Path, mf.Manifest], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Verify off, no SHA-256 binds what was read: a write in place between the stat the
    pin is taken from and the end of the read could be served as a mix of old and new
    bytes (the stat pin caught it only at the next wakeup, after serving them). The stat
    after the read must be the one before it: 422. The seam only places the real
    ``pwrite`` just before or just after the read."""
    from services.worker import hf_files

    ipc_dir, man = ipc
    shard = ipc_version_dir(ipc_dir, MODEL, "s1") / "rank0-of-2.safetensors"
    end = shard.stat().st_size

    def write() -> None:  # the last byte rewritten as it is: only the stat says so
        fd = os.open(shard, os.O_RDWR)
        try:
            os.pwrite(fd, os.pread(fd, 1, end - 1), end - 1)
        finally:
            os.close(fd)

    def read_file(*args: object) -> object:
        if when == "before":
            write()
        buf = real_read_file(*args)  # type: ignore[arg-type]
        if when == "after":
            write()
        return buf

    real_read_file = hf_files.read_file
    monkeypatch.setattr(hf_files, "read_file", read_file)
    msg = refused(ipc_dir, man, 0, verify=False)
    assert "changed while read" in msg, msg
    monkeypatch.setattr(hf_files, "read_file", real_read_file)
    assert load(ipc_dir, man, 0, verify=False)  # unchanged: served
