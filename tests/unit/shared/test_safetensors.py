"""The one safetensors header parser: agrees with ``safetensors`` on real files (bf16
included) and refuses hostile headers with an error naming the file and tensor."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from shared import safetensors as st


def blob(header: dict[str, Any], data: bytes, *, length: int | None = None) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head) if length is None else length) + head + data


def entry(dtype: str, shape: list[int], a: int, b: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}


def test_parses_what_safetensors_writes() -> None:
    arrays = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.arange(4, dtype=np.float16),
        "c": np.array(7, dtype=np.int64),
        "z": np.zeros((0, 3), np.float32),
    }
    data = save(arrays, metadata={"format": "np"})
    h = st.parse(data, "x.safetensors")
    assert h.metadata == {"format": "np"}
    got = st.views(data, h)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype
        np.testing.assert_array_equal(got[k], v)
    assert h.tensors["a"].dtype_name == "float32" and h.tensors["a"].nbytes == 24


def test_bf16_written_by_torch_reads_exactly(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    x = torch.randn(4, 6).to(torch.bfloat16)
    save_file({"w": x, "f": x.float()}, str(tmp_path / "m.safetensors"))
    h = st.read_header(tmp_path / "m.safetensors")
    assert h.tensors["w"].dtype == "BF16" and h.tensors["w"].dtype_name == "bfloat16"
    raw = st.views((tmp_path / "m.safetensors").read_bytes(), h)
    assert st.dtype_name(raw["w"].dtype) == "bfloat16"
    # slices / transposes of the raw 2-byte data stay marked, and convert exactly
    assert st.dtype_name(raw["w"][1:3].T.dtype) == "bfloat16"
    np.testing.assert_array_equal(st.convert(raw["w"], "float32"), x.float().numpy())
    np.testing.assert_array_equal(st.convert(raw["f"], "bfloat16"), raw["w"])
    assert st.st_dtype(raw["w"].dtype) == "BF16" and st.st_dtype(raw["f"].dtype) == "F32"


def test_fp16_and_bf16_round_to_nearest_like_torch() -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    x[:3] = [np.inf, -np.inf, 0.0]
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(st.convert(x, "bfloat16"), want)
    assert st.dtype_name(st.convert(x, "float16").dtype) == "float16"


def raw_header(text: str, data: bytes) -> bytes:
    """A file whose header is ``text`` verbatim (JSON a dict cannot hold)."""
    head = text.encode() + b" " * (-len(text) % 8)
    return struct.pack("<Q", len(head)) + head + data


HOSTILE = [
    # (what, file bytes, message pattern)
    ("short", b"\x01\x02", r"2 bytes, shorter than the 8-byte header length"),
    ("huge header length", struct.pack("<Q", 1 << 62) + b"{}", r"header length \d+ is more"),
    ("header past the end", struct.pack("<Q", 64) + b"{}", r"runs past the end"),
    ("not json", blob({}, b"")[:8] + b"{x", r"not JSON"),
    ("not an object", struct.pack("<Q", 2) + b"[]", r"not a JSON object"),
    (
        "unknown dtype",
        blob({"w": entry("F8_E4M3", [4], 0, 4)}, bytes(4)),
        r"tensor 'w': unknown dtype 'F8_E4M3'",
    ),
    (
        "shape × itemsize != length",
        blob({"w": entry("F32", [3], 0, 8)}, bytes(8)),
        r"tensor 'w': shape \[3\] × F32 is 12 bytes, its offsets 0..8 hold 8",
    ),
    (
        "out of range",
        blob({"w": entry("F32", [4], 0, 16)}, bytes(8)),
        r"tensor 'w': bytes 0..16 lie outside the data \(8 bytes\)",
    ),
    (
        "reversed offsets",
        blob({"w": entry("F32", [0], 8, 0)}, bytes(8)),
        r"tensor 'w': bytes 8..0 lie outside",
    ),
    (
        "overlap",
        blob({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
        r"tensor 'b': bytes 4..12 overlap the previous tensor",
    ),
    (
        "gap",
        blob({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
        r"tensor 'b': bytes 8..12 leave a gap",
    ),
    ("trailing", blob({"a": entry("F32", [1], 0, 4)}, bytes(8)), r"4 trailing bytes"),
    (
        "negative dim",
        blob({"w": entry("F32", [-1], 0, 0)}, b""),
        r"tensor 'w': shape \[-1\] is not a list of non-negative ints",
    ),
    (
        "bad offsets",
        blob({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)),
        r"tensor 'w': data_offsets \[0\] are not two",
    ),
    ("entry not object", blob({"w": 3}, b""), r"tensor 'w': entry is not an object"),
    (
        # safetensors keeps the last of each: a=bytes 4..8, b=bytes 0..4, a valid swap
        "name twice",
        raw_header(
            '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},'
            '"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},'
            '"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
            bytes(8),
        ),
        r"'a' appears twice in one header object",
    ),
    (
        "bool as int",
        blob({"w": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, bytes(1)),
        r"tensor 'w': shape \[True\]",
    ),
]


@pytest.mark.parametrize("what,data,pattern", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_headers_are_refused_naming_file_and_tensor(
    tmp_path: Path, what: str, data: bytes, pattern: str
) -> None:
    with pytest.raises(st.SafetensorsError, match=r"^rank 1: v/x\.st: .*" + pattern):
        st.parse(data, "rank 1: v/x.st")
    p = tmp_path / "x.st"  # the file reader says the same, reading only the header
    p.write_bytes(data)
    with pytest.raises(st.SafetensorsError, match=r"^x\.st: .*" + pattern):
        st.read_header(p)


def test_huge_header_length_is_refused_before_reading(tmp_path: Path) -> None:
    """A length within the file but over the bound: refused from the 8 bytes alone."""
    n = st.MAX_HEADER_BYTES + 8
    with pytest.raises(st.SafetensorsError, match=f"header length {n} is more"):
        st.header_length(struct.pack("<Q", n), n + 8, "f")


def test_encode_header_round_trips() -> None:
    meta = {"w": entry("BF16", [2, 2], 0, 8)}
    head = st.encode_header(meta)
    assert len(head) % 8 == 0
    h = st.parse(head + bytes(8), "f")
    assert h.tensors["w"] == st.Entry("BF16", (2, 2), len(head), len(head) + 8)


def test_checkpoint_files_follow_the_index(tmp_path: Path) -> None:
    for f in ("a.safetensors", "b.safetensors", "stray.safetensors"):
        (tmp_path / f).write_bytes(save({"x": np.zeros(1, np.float16)}))
    assert [p.name for p in st.checkpoint_files(tmp_path)] == [
        "a.safetensors",
        "b.safetensors",
        "stray.safetensors",
    ]
    index = tmp_path / st.INDEX_FILE
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "a.safetensors"}}))
    assert [p.name for p in st.checkpoint_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    assert st.checkpoint_dtype(st.checkpoint_files(tmp_path)) == "float16"
    index.write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(ValueError, match="not a file name inside the dir"):
        st.checkpoint_files(tmp_path)
    index.write_text("[]")
    with pytest.raises(ValueError, match="no valid weight_map"):
        st.checkpoint_files(tmp_path)
