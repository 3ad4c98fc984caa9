"""HF safetensors snapshots in bf16 / fp16 / fp32 load as float32, each rank its slice."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from services.worker import hf_files
from services.worker.weights import SnapshotSource
from shared import safetensors as st
from shared import sharding
from shared.model_config import ModelConfig


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """tensors: name -> (safetensors dtype, raw array of that dtype's bytes)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, raw) in tensors.items():
        data = np.ascontiguousarray(raw).tobytes()
        header[name] = {"dtype": dtype, "shape": list(raw.shape),
                        "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bf16 encoding of float32 values that bf16 represents exactly."""
    bits = x.astype(np.float32).view(np.uint32)
    assert not (bits & 0xFFFF).any()
    return (bits >> 16).astype(np.uint16)


CFG = ModelConfig(
    vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
)  # fmt: skip


def exact_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # multiples of 1/8 in [-4, 4]: exact in bf16 and fp16
    return {
        n: (rng.integers(-32, 33, size=s) / 8).astype(np.float32)
        for n, s in sharding.full_shapes(CFG).items()
    }


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("tp", [1, 2])
def test_snapshot_loads_any_float_dtype_as_fp32_slices(tmp_path: Path, dtype: str, tp: int) -> None:
    full = exact_weights(0)
    enc = {
        "BF16": bf16_bits,
        "F16": lambda a: a.astype(np.float16),
        "F32": lambda a: a,
    }[dtype]
    names = list(full)
    # a sharded checkpoint: two files, plus a tensor the model does not use
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                      {n: (dtype, enc(full[n])) for n in names[: len(names) // 2]})  # fmt: skip
    rest = {n: (dtype, enc(full[n])) for n in names[len(names) // 2 :]}
    rest["model.rotary_emb.inv_freq"] = ("F32", np.ones(4, np.float32))
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", rest)
    for rank in range(tp):
        shard = SnapshotSource(CFG, tmp_path, rank, tp)("v0", False)
        assert set(shard.arrays) == set(names)
        for n in names:
            got = shard.arrays[n]
            assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable
            np.testing.assert_array_equal(got, sharding.shard_tensor(CFG, n, full[n], rank, tp))


def test_bf16_conversion_is_exact_upper_half() -> None:
    x = np.array([1.0, -2.5, 3.140625, 0.0, -0.0, 65280.0], np.float32)
    out = st.convert(bf16_bits(x).view(st.BFLOAT16), "float32")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(st.convert(x, "bfloat16"), bf16_bits(x))


def test_non_float_tensor_and_bad_offsets_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "a.safetensors"
    write_safetensors(p, {"w": ("I32", np.arange(4, dtype=np.int32))})
    with pytest.raises(ValueError, match="int32"):
        hf_files.read_slices(p, {"w"}, lambda n, s: None)
    write_safetensors(p, {"w": ("F32", np.arange(4, dtype=np.float32))})
    raw = bytearray(p.read_bytes())
    p.write_bytes(bytes(raw[:-4]))  # truncated data
    with pytest.raises(ValueError, match="a.safetensors.*tensor 'w': bytes 0..16 lie outside"):
        hf_files.read_slices(p, {"w"}, lambda n, s: None)


def test_compute_dtype_is_fp32_on_cpu_and_the_checkpoints_on_gpu() -> None:
    for stored in ("float32", "bfloat16", "float16"):
        assert hf_files.compute_dtype("float32", "cpu", stored) == "float32"
        assert hf_files.compute_dtype("auto", "cpu", stored) == "float32"
        assert hf_files.compute_dtype("float32", "gpu", stored) == "float32"
        assert hf_files.compute_dtype("auto", "gpu", stored) == stored
    assert hf_files.compute_dtype("auto", "gpu", "float64") == "float32"
    with pytest.raises(ValueError):
        hf_files.compute_dtype("int8")


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_compute_dtype_on_gpu_keeps_the_checkpoint_dtype(tmp_path: Path, dtype: str) -> None:
    """SnapshotSource in bf16 / fp16 (what ``auto`` picks on a GPU): the rank holds the
    checkpoint's own bytes, bf16 as raw 2-byte data (paddle reads uint16 as bfloat16)."""
    full = exact_weights(1)
    enc = bf16_bits if dtype == "BF16" else (lambda a: a.astype(np.float16))
    write_safetensors(tmp_path / "model.safetensors", {n: (dtype, enc(a)) for n, a in full.items()})
    files = [tmp_path / "model.safetensors"]
    want = {"BF16": "bfloat16", "F16": "float16"}[dtype]
    assert st.checkpoint_dtype(files) == want
    shard = SnapshotSource(CFG, tmp_path, 1, 2, hf_files.compute_dtype("auto", "gpu", want))(
        "v0", False
    )
    for n, a in full.items():
        got = shard.arrays[n]
        assert st.dtype_name(got.dtype) == want
        np.testing.assert_array_equal(got, enc(sharding.shard_tensor(CFG, n, a, 1, 2)))


def test_rank_reads_only_its_slice_bytes(tmp_path: Path) -> None:
    """Column-parallel tensors (split on dim 0) and row-parallel ones (dim 1): the bytes
    read are exactly the rank's parts plus the replicated tensors, half the file's
    split tensors at tp=2."""
    full = exact_weights(2)
    write_safetensors(
        tmp_path / "model.safetensors", {n: ("BF16", bf16_bits(a)) for n, a in full.items()}
    )
    split = sum(a.size * 2 for n, a in full.items() if sharding.split_axis(n) is not None)
    whole = sum(a.size * 2 for n, a in full.items() if sharding.split_axis(n) is None)
    for rank in range(2):
        shard = SnapshotSource(CFG, tmp_path, rank, 2)("v0", False)
        assert shard.nbytes == whole + split // 2


def test_read_file_of_a_file_shorter_than_its_size_is_oserror(tmp_path: Path) -> None:
    """A file cut short since its size was checked: the read's own error (the sources
    make it a 422 naming the file), by path or by descriptor. Before, the buffer's
    ``close`` on the way out failed (a view of it was still held) and raised
    BufferError instead."""
    import os

    p = tmp_path / "x.safetensors"
    p.write_bytes(b"\0" * 5000)
    with pytest.raises(OSError, match="file ended at byte 5000"):
        hf_files.read_file(p, 9000, "w")
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="file ended at byte 5000"):
            hf_files.read_file(fd, 9000, "w")
        assert bytes(hf_files.read_file(fd, 5000, "w")) == b"\0" * 5000
    finally:
        os.close(fd)


def _resident(buf: object) -> int:
    """Bytes of ``buf`` (an anonymous mapping) in memory now: ``mincore`` over its
    pages, exact (RSS would count every other allocation of the process too)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    holder = ctypes.c_char.from_buffer(buf)  # type: ignore[arg-type]
    addr = ctypes.addressof(holder)
    del holder  # the export: the buffer must stay closable
    n = len(buf)  # type: ignore[arg-type]
    pages = -(-n // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(addr, n, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_a_converted_shard_frees_each_tensors_read_bytes_as_it_goes(
    tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 / fp16 shard read whole (ipc, pre-sharded) and converted to the fp32
    compute dtype: the bytes of a tensor once converted are never read again, so their
    pages go back as each tensor is converted. Kept, the whole half-precision shard
    stayed resident beside the fp32 result until the load ended: the peak was 1.5x
    the weights (the ipc mapping it replaced cost nothing beside them). Non-float
    tensors stay views of the buffer (kept), and every value is still right."""
    rng = np.random.default_rng(5)
    w = {f"w{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(6)}
    raw = {
        n: (a.view(np.uint32) >> 16).astype(np.uint16) if dtype == "BF16" else a.astype(np.float16)
        for n, a in w.items()
    }
    ids = np.arange(4096, dtype=np.int64)
    p = tmp_path / "s.safetensors"
    tensors = {n: (dtype, r) for n, r in raw.items()}
    names = list(tensors)  # a kept view between converted tensors: its pages stay
    tensors = {**{n: tensors[n] for n in names[:3]}, "ids": ("I64", ids),
               **{n: tensors[n] for n in names[3:]}}  # fmt: skip
    write_safetensors(p, tensors)
    buf = hf_files.read_file(p, p.stat().st_size, "w")
    whole = _resident(buf)
    assert whole >= len(buf) - 4096  # all read in
    left = sum(r.nbytes for r in raw.values())
    seen: list[tuple[int, int]] = []  # (resident, bytes of float tensors not yet converted)
    real_convert = st.convert

    def convert(a: np.ndarray, target: str) -> np.ndarray:
        nonlocal left
        seen.append((_resident(buf), left))
        left -= a.nbytes
        return real_convert(a, target)

    monkeypatch.setattr(st, "convert", convert)
    got = hf_files.load_buffer(buf, "w", "float32")
    slack = ids.nbytes + 64 * 1024  # the header, ids and a page either side of each tensor
    assert len(seen) == len(raw)
    for resident, unconverted in seen:
        assert resident <= unconverted + slack, seen
    assert _resident(buf) <= slack
    for n in w:
        want = (raw[n].astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw[n]
        np.testing.assert_array_equal(got[n], want.astype(np.float32), err_msg=n)
    np.testing.assert_array_equal(got["ids"], ids)  # a view, its pages kept
    assert list(got) == list(tensors)  # in the header's order still
    del got
    buf.close()


@pytest.mark.parametrize("advice", ["MADV_HUGEPAGE", "MADV_DONTNEED"])
def test_a_refused_memory_hint_never_fails_the_load(
    tmp_path: Path, advice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Huge pages for the read and giving converted bytes back are memory hints only: a
    kernel without THP or a seccomp filter refuses the ``madvise`` (EINVAL / EPERM) and
    the shard still loads, every value right. The advice made unknown to the kernel
    (a real EINVAL) stands for such a host."""
    import mmap

    monkeypatch.setattr(mmap, advice, 0x7FFF, raising=False)
    w = np.random.default_rng(3).standard_normal((512, 1024)).astype(np.float32)
    raw = (w.view(np.uint32) >> 16).astype(np.uint16)
    p = tmp_path / "s.safetensors"
    write_safetensors(p, {"a": ("BF16", raw), "b": ("BF16", raw[::-1].copy())})
    got = hf_files.load_buffer(hf_files.read_file(p, p.stat().st_size, "w"), "w", "float32")
    want = (raw.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got["a"], want)
    np.testing.assert_array_equal(got["b"], want[::-1])
