import pytest

from shared import manifest as mf
from shared.errors import ControlError


def _spec(shape: list[int], dtype: str = "float32") -> mf.TensorSpec:
    return mf.TensorSpec(shape=shape, dtype=dtype)


def test_roundtrip_and_lookup() -> None:
    man = mf.Manifest(
        "m",
        "v1",
        2,
        [
            mf.ShardSpec(r, f"rank{r}-of-2.safetensors", 10, "ab", {"w": _spec([2])})
            for r in range(2)
        ],
    )
    again = mf.decode(mf.encode(man))
    assert again == man and again.total_bytes == 20 and again.shard(1).rank == 1
    with pytest.raises(ControlError) as e:
        again.shard(5)
    assert e.value.code == 422


def test_invalid_manifest_is_422() -> None:
    with pytest.raises(ControlError) as e:
        mf.decode(b'{"model": 1}', "x/manifest.json")
    assert e.value.code == 422 and "x/manifest.json" in e.value.message


@pytest.mark.parametrize(
    "got, needle",
    [
        ({}, "missing"),
        ({"w": _spec([2, 2]), "extra": _spec([1])}, "unexpected"),
        ({"w": _spec([2, 3])}, "shape"),
        ({"w": _spec([2, 2], "float16")}, "dtype"),
    ],
)
def test_check_tensors_names_the_problem(got: dict[str, mf.TensorSpec], needle: str) -> None:
    with pytest.raises(ControlError) as e:
        mf.check_tensors({"w": _spec([2, 2])}, got, "rank 1")
    assert e.value.code == 422 and needle in e.value.message and "rank 1" in e.value.message


def test_sha256_of_chunks() -> None:
    import hashlib

    assert mf.sha256_of([b"ab", memoryview(b"cd")]) == hashlib.sha256(b"abcd").hexdigest()


# --------------------------------------------------------------------------- validate

EXPECTED = {"w": _spec([4, 8]), "b": _spec([8], "float16")}  # 128 + 16 data bytes


def _man(size: int = 144 + 200, **over: object) -> mf.Manifest:
    shards = [
        mf.ShardSpec(r, f"rank{r}-of-2.safetensors", size, "a" * 64, dict(EXPECTED))
        for r in range(2)
    ]
    man = mf.Manifest("m", "v1", 2, shards)
    for k, v in over.items():
        setattr(man.shards[1], k, v)
    return man


def test_tensor_bytes_from_shapes_and_dtypes() -> None:
    assert mf.tensor_bytes(EXPECTED, "x") == 4 * 8 * 4 + 8 * 2
    with pytest.raises(ControlError, match="bad dtype"):
        mf.tensor_bytes({"w": _spec([2], "complex512")}, "x")


def test_valid_manifest_passes() -> None:
    assert mf.validate(_man(), 1, 2, EXPECTED, "m/v1").rank == 1


@pytest.mark.parametrize("size", [50_000_000_000, 144 + 8, 144 + mf.header_allowance(2) + 1, 0])
def test_forged_size_is_422_naming_rank_and_file(size: int) -> None:
    with pytest.raises(ControlError) as e:
        mf.validate(_man(size=size), 1, 2, EXPECTED, "m/v1")
    assert e.value.code == 422
    msg = e.value.message
    assert "rank 1" in msg and "m/v1/rank1-of-2.safetensors" in msg and str(size) in msg


def test_forged_tensors_are_422_before_any_read() -> None:
    big = {"w": _spec([4, 8 << 30]), "b": _spec([8], "float16")}
    with pytest.raises(ControlError, match="rank 1.*w has shape"):
        mf.validate(_man(tensors=big, size=50 << 30), 1, 2, EXPECTED, "m/v1")


@pytest.mark.parametrize(
    "name",
    ["../v0/rank1-of-2.safetensors", "/etc/passwd", "a/b.safetensors", "..", ".hidden",
     "x\\y", "", "rank1..safetensors"],
)
def test_file_names_are_confined_to_the_version(name: str) -> None:
    with pytest.raises(ControlError) as e:
        mf.validate(_man(file=name), 0, 2, EXPECTED, "m/v1")
    assert e.value.code == 422 and "plain file name" in e.value.message


def test_ranks_tp_and_digest_shape_are_checked() -> None:
    with pytest.raises(ControlError, match="tp=2, serving tp=4"):
        mf.validate(_man(), 0, 4, EXPECTED, "m/v1")
    with pytest.raises(ControlError, match="ranks"):
        mf.validate(_man(rank=0), 0, 2, EXPECTED, "m/v1")
    with pytest.raises(ControlError, match="sha256"):
        mf.validate(_man(sha256="zz"), 1, 2, EXPECTED, "m/v1")


def test_file_size_without_manifest_is_bounded_by_the_served_tensors() -> None:
    mf.check_file_size(144 + 100, EXPECTED, "rank 0: f")
    mf.check_file_size(1 << 40, None, "rank 0: f")  # nothing known yet: not checked
    with pytest.raises(ControlError, match="rank 0: f: size"):
        mf.check_file_size(50_000_000_000, EXPECTED, "rank 0: f")


def test_stored_float_dtype_may_differ_from_the_served_one() -> None:
    """A bf16 / fp16 manifest fits an fp32-serving rank (converted on load); sizes are
    checked with the stored dtype; a non-float dtype still has to match."""
    served = {"w": mf.TensorSpec([4, 8], "float32")}
    for stored in ("bfloat16", "float16", "float32"):
        mf.check_tensors(served, {"w": mf.TensorSpec([4, 8], stored)}, "x", stored=True)
    with pytest.raises(ControlError, match="w has dtype bfloat16, expected float32"):
        mf.check_tensors(served, {"w": mf.TensorSpec([4, 8], "bfloat16")}, "x")
    with pytest.raises(ControlError, match="w has dtype int32"):
        mf.check_tensors(served, {"w": mf.TensorSpec([4, 8], "int32")}, "x", stored=True)
    mf.check_file_size(8 + 64 + 32 * 2, served, "x")  # a bf16 shard without manifest fits
    with pytest.raises(ControlError, match="does not fit"):
        mf.check_file_size(8 + 32, served, "x")
