"""A state dict whose weight is not floating point is refused before any byte moves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from services.tiny_model import create_model_dir
from services.trainer.publisher import CheckpointPublisher, read_model_dir
from shared import safetensors as st


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool", "uint8"])
def test_non_float_weight_is_refused(tmp_path: Path, dtype: str) -> None:
    """An int64 ``lm_head.weight`` (a trainer bug: a mask or ids passed as a weight) was
    published as I64 shards that no rank can serve (ranks take float dtypes only)."""
    d = create_model_dir(tmp_path / "m")
    _, state = read_model_dir(d)
    state = {k: np.array(v) for k, v in state.items()}
    state["lm_head.weight"] = state["lm_head.weight"].astype(dtype)
    cfg = json.loads((d / "config.json").read_text())
    pub = CheckpointPublisher("nats://127.0.0.1:1")
    with pytest.raises(ValueError, match=rf"lm_head\.weight: dtype {dtype}"):
        pub.prepare("m", "v1", state, tp=1, config=cfg)


def test_float_and_bf16_weights_pass(tmp_path: Path) -> None:
    d = create_model_dir(tmp_path / "m")
    _, state = read_model_dir(d)
    state = {k: np.array(v) for k, v in state.items()}
    cfg = json.loads((d / "config.json").read_text())
    # raw bf16 (the upper half of each float32), as a bf16 HF dir is read
    state["lm_head.weight"] = (
        (state["lm_head.weight"].view(np.uint32) >> 16).astype(np.uint16).view(st.BFLOAT16)
    )
    _, man = CheckpointPublisher("nats://127.0.0.1:1").prepare("m", "v1", state, tp=1, config=cfg)
    assert man.shards[0].tensors["lm_head.weight"].dtype == "bfloat16"
