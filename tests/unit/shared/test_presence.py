"""The "not yet present" rule of a snapshot dir (shared/presence.py), on real files: a
copy in progress (missing or short files) waits, a complete but broken dir does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from services.tiny_model import TINY_CONFIG, create_model_dir
from services.trainer.shards import write_sharded_dir
from shared import sharding
from shared.model_config import ModelConfig
from shared.presence import short_file, snapshot_pending
from shared.safetensors import INDEX_FILE

CFG = ModelConfig.from_hf(TINY_CONFIG)


def cut(f: Path, n: int) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(n)


def test_presharded_dir_mid_copy_waits_a_complete_one_does_not(tmp_path: Path) -> None:
    d = tmp_path / "s1"
    man = write_sharded_dir(d, CFG, sharding.init_weights(CFG, 1), 2, "m", "s1")
    assert snapshot_pending(d, 2, range(2)) is None
    rank1 = d / man.shards[1].file
    full = rank1.read_bytes()
    cut(rank1, len(full) // 2)  # still being written
    why = snapshot_pending(d, 2, range(2))
    assert why == f"rank1-of-2.safetensors has {len(full) // 2} of {len(full)} bytes", why
    assert snapshot_pending(d, 2, [0]) is None  # rank 0's own file is complete
    rank1.unlink()  # named by the manifest, not copied yet
    assert "rank1-of-2.safetensors is not there yet" == snapshot_pending(d, 2, [1])
    rank1.write_bytes(full + b"x")  # longer than the manifest says: broken, not pending
    assert snapshot_pending(d, 2, range(2)) is None
    flipped = bytearray(full)
    flipped[-1] ^= 1  # right size, wrong bytes: broken (the load's SHA-256 says 422)
    rank1.write_bytes(bytes(flipped))
    assert snapshot_pending(d, 2, range(2)) is None
    (d / "manifest.json").write_text("[1, 2] x")  # a manifest that does not parse: broken
    assert snapshot_pending(d, 2, range(2)) is None
    (d / "manifest.json").write_text("nope")
    assert snapshot_pending(d, 2, range(2)) is None


def test_a_json_file_cut_short_is_being_copied_not_broken(tmp_path: Path) -> None:
    """``cp`` creates manifest.json (or the index) empty, then writes it: caught in
    between, or part-written, it is a copy in progress (404, waited for) — before, a 422
    that auto-update refused for good, also after a restart (the refused set is stored)."""
    d = tmp_path / "s1"
    write_sharded_dir(d, CFG, sharding.init_weights(CFG, 1), 2, "m", "s1")
    man = (d / "manifest.json").read_bytes()
    for n in (0, 1, len(man) // 2, len(man.rstrip()) - 1):
        (d / "manifest.json").write_bytes(man[:n])
        assert snapshot_pending(d, 2, range(2)) == (
            f"manifest.json has {n} bytes, not a whole JSON document yet"
        ), n
    (d / "manifest.json").write_bytes(man)
    assert snapshot_pending(d, 2, range(2)) is None

    src = create_model_dir(tmp_path / "m", TINY_CONFIG, seed=0)
    h = tmp_path / "v"
    h.mkdir()
    shutil.copy(src / "model.safetensors", h / "a.safetensors")
    index = json.dumps({"weight_map": {"x": "a.safetensors"}}).encode()
    for n in (0, len(index) - 1):
        (h / INDEX_FILE).write_bytes(index[:n])
        assert snapshot_pending(h, 1, [0]) == (
            f"{INDEX_FILE} has {n} bytes, not a whole JSON document yet"
        ), n
    (h / INDEX_FILE).write_bytes(index)
    assert snapshot_pending(h, 1, [0]) is None


def test_presharded_without_manifest_judged_by_the_header(tmp_path: Path) -> None:
    d = tmp_path / "s1"
    write_sharded_dir(d, CFG, sharding.init_weights(CFG, 1), 2, "m", "s1")
    (d / "manifest.json").unlink()
    f = d / "rank0-of-2.safetensors"
    full = f.read_bytes()
    assert snapshot_pending(d, 2, range(2)) is None
    for n in (0, 5, 12, len(full) - 1):  # empty, inside the length, the header, the data
        cut(f, n)
        assert snapshot_pending(d, 2, range(2)), n
        f.write_bytes(full)
    (d / "rank1-of-2.safetensors").unlink()  # another rank's file there: this one comes
    assert snapshot_pending(d, 2, [1]) == "rank1-of-2.safetensors is not there yet"


def test_hf_dir_waits_for_every_file_its_index_names(tmp_path: Path) -> None:
    src = create_model_dir(tmp_path / "m", TINY_CONFIG, seed=0)
    d = tmp_path / "v"
    d.mkdir()
    assert snapshot_pending(d, 1, [0]) == "no weight file (manifest.json, *.safetensors) yet"
    shutil.copy(src / "model.safetensors", d / "a.safetensors")
    assert snapshot_pending(d, 1, [0]) is None  # no index: what is there is the checkpoint
    (d / INDEX_FILE).write_text(
        json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})
    )
    assert snapshot_pending(d, 1, [0]) == "b.safetensors is not there yet"
    shutil.copy(src / "model.safetensors", d / "b.safetensors")
    assert snapshot_pending(d, 1, [0]) is None
    size = (d / "b.safetensors").stat().st_size
    cut(d / "b.safetensors", size - 1)
    assert snapshot_pending(d, 1, [0]) == f"b.safetensors has {size - 1} of {size} bytes"
    (d / INDEX_FILE).write_text("not json")  # a bad index: broken, the load says 422
    assert snapshot_pending(d, 1, [0]) is None


def test_a_file_whose_header_is_not_json_is_broken_not_pending(tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes((4).to_bytes(8, "little") + b"nope" + b"\0" * 16)
    assert short_file(f, "x") is None
    f.write_bytes((1 << 40).to_bytes(8, "little"))  # a length no header has
    assert short_file(f, "x") is None
    f.write_bytes((64).to_bytes(8, "little") + b"{")  # the header itself is cut
    assert short_file(f, "x") == "x has 9 bytes, its header alone 72"


def test_hf_shard_names_say_which_file_is_still_to_come(tmp_path: Path) -> None:
    src = create_model_dir(tmp_path / "m", TINY_CONFIG, seed=0)
    d = tmp_path / "v"
    d.mkdir()
    shutil.copy(src / "model.safetensors", d / "model-00002-of-00003.safetensors")
    assert snapshot_pending(d, 1, [0]) == "model-00001-of-00003.safetensors is not there yet"
    shutil.copy(src / "model.safetensors", d / "model-00001-of-00003.safetensors")
    assert snapshot_pending(d, 1, [0]) == "model-00003-of-00003.safetensors is not there yet"
    shutil.copy(src / "model.safetensors", d / "model-00003-of-00003.safetensors")
    assert snapshot_pending(d, 1, [0]) is None
