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
