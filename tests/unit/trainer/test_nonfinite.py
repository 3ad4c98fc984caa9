"""A weight holding NaN or ±Inf is refused while the shard is written (the check rides
on the fill's hashing pass): named by its inference name, for every float dtype, in the
copied (transposed) and the sent-from-source (contiguous) paths alike."""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import numpy as np
import pytest

from services.tiny_model import TINY_CONFIG
from services.trainer import names, shards
from shared import safetensors as st
from shared import sharding
from shared.model_config import ModelConfig

CFG = ModelConfig.from_hf(dict(TINY_CONFIG))
DOWN = "model.layers.3.mlp.down_proj.weight"  # the last element of the last block
DTYPES = ["float32", "float64", "float16", "bfloat16"]


def _state(dtype: str, bad: str | None = None, value: float = float("nan")) -> dict[str, Any]:
    w = sharding.init_weights(CFG, 3)
    if bad is not None:
        w[bad] = w[bad].copy()
        w[bad][-1, -1] = value
    if dtype == "float64":
        return {k: v.astype(np.float64) for k, v in w.items()}
    return {k: st.convert(v, dtype) for k, v in w.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value,what", [(float("nan"), "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
@pytest.mark.parametrize("tp", [1, 2])
def test_serialize_refuses_a_non_finite_weight(
    dtype: str, value: float, what: str, tp: int
) -> None:
    state = _state(dtype, DOWN, value)
    with pytest.raises(shards.NonFiniteWeight, match=f"tensor {DOWN} holds {what}") as e:
        shards.serialize(CFG, state, tp, "m", "v", check_finite=True)
    assert e.value.tensor == DOWN and e.value.rank == tp - 1  # down_proj splits its columns
    shards.serialize(CFG, state, tp, "m", "v")  # the opt-out writes it as it is


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_extremes_pass(dtype: str) -> None:
    """The largest and smallest finite values, and subnormals, are no NaN/Inf."""
    top = {"float16": 65504.0, "bfloat16": 3.3e38, "float32": 3.4e38}.get(dtype, 1.7e308)
    state = _state(dtype)
    for name, v in ((DOWN, top), ("model.norm.weight", -top), ("lm_head.weight", 1e-40)):
        w = sharding.init_weights(CFG, 3)[name].astype(np.float64)
        w.flat[:2] = v  # two: their sum overflows (no NaN/Inf for all that)
        state[name] = w if dtype == "float64" else st.convert(w.astype(np.float32), dtype)
    shards.serialize(CFG, state, 2, "m", "v", check_finite=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_transposed_training_tensor_is_checked_where_it_is_copied(dtype: str) -> None:
    """Training layout: linears are transposed views, copied tile by tile into the shard."""
    state = _state(dtype, DOWN)
    train = names.to_training(state, CFG)
    hf = names.to_inference(train, CFG, contiguous=False)
    assert not hf[DOWN].flags.c_contiguous
    with pytest.raises(shards.NonFiniteWeight, match=DOWN):
        shards.serialize(CFG, hf, 2, "m", "v", check_finite=True)


def test_a_contiguous_tensor_sent_from_its_source_is_checked() -> None:
    """``skip_direct``: the publisher's path, where a contiguous tensor is only hashed
    (its bytes are sent from the tensor itself, never copied)."""
    name = "model.embed_tokens.weight"
    state = _state("float32", name, np.inf)
    (lay,) = shards.plan_shards(CFG, state, 1) or []
    assert any(n == name and src.flags.c_contiguous for n, src, _ in lay.parts)
    buf = bytearray(lay.size)
    with pytest.raises(shards.NonFiniteWeight, match=name):
        lay.fill(buf, hashlib.sha256(), skip_direct=True, check_finite=True)
    lay.fill(buf, hashlib.sha256(), skip_direct=True)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_sum_that_overflows_both_ways_is_no_warning(dtype: str) -> None:
    """Finite values whose block sum overflows to +Inf and to -Inf (NaN: numpy's
    "invalid value") pass without a RuntimeWarning — one is an error under ``-W error``
    (a finite checkpoint refused) and a second stderr line of ``rollbus publish``; a real
    ±Inf pair is refused as Inf, with no warning either."""
    top = {"float32": 3.0e38, "float64": 1.7e308}[dtype]
    state = _state(dtype)
    w = np.array(state[DOWN], dtype=np.float64)
    w[:2, :] = top
    w[2:4, :] = -top
    state[DOWN] = w.astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shards.serialize(CFG, state, 2, "m", "v", check_finite=True)
        state[DOWN][-1, -2:] = [np.inf, -np.inf]
        with pytest.raises(shards.NonFiniteWeight, match=f"tensor {DOWN} holds Inf"):
            shards.serialize(CFG, state, 2, "m", "v", check_finite=True)
