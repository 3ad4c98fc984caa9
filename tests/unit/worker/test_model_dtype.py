"""The model computes in its weights' dtype, with a KV cache of that dtype: on a GPU the
checkpoint's bf16 / fp16 (``hf_files.compute_dtype``), which paddle's CPU kernels do not
offer (bf16 ``mean`` is not registered), so the dtype plumbing is checked here with
float64, the other float dtype the CPU has: the RoPE tables and attention masks (built
in float32) follow the weights, the cache holds them, the logits come back float32 —
equal to the float32 model's. Without it, a non-float32 forward fails at the first
cache write (``scatter_`` of the new keys into a float32 cache)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from services.worker.model import Batch, KVCache, TPModel
from shared.sharding import init_weights
from tests.unit.worker.test_model import tiny


@pytest.mark.parametrize("overrides", [{}, {"qk_norm": True, "attention_bias": True}])
def test_float64_weights_and_cache_compute_the_float32_answer(overrides: dict) -> None:
    cfg = tiny(**overrides)
    w = {k: v if k.endswith("norm.weight") else v * 10 for k, v in init_weights(cfg, 3).items()}
    prompts = [[5, 17, 200, 3, 99, 42, 7], [250, 1]]
    tables = [[0, 1], [3]]
    answers = {}
    for dtype in ("float32", "float64"):
        weights = {k: paddle.to_tensor(v.astype(dtype)) for k, v in w.items()}
        kv = KVCache(cfg, 6, 4, 1, dtype)
        assert kv.keys[0].dtype == getattr(paddle, dtype)
        assert kv.nbytes == 2 * cfg.num_hidden_layers * 6 * cfg.num_key_value_heads * 4 * (
            cfg.head_dim * np.dtype(dtype).itemsize
        )
        model = TPModel(cfg, 0, 1)
        first = model.forward(weights, kv, Batch(prompts, [0, 0], tables))  # prefill
        nxt = [int(t) for t in first.numpy().argmax(-1)]
        second = model.forward(weights, kv, Batch([[t] for t in nxt], [7, 2], tables))  # decode
        assert first.dtype == second.dtype == paddle.float32
        answers[dtype] = np.concatenate([first.numpy(), second.numpy()])
    np.testing.assert_allclose(answers["float64"], answers["float32"], rtol=1e-4, atol=1e-4)


def test_a_cache_of_another_dtype_than_the_weights_is_refused() -> None:
    cfg = tiny()
    weights = {k: paddle.to_tensor(v.astype("float64")) for k, v in init_weights(cfg, 0).items()}
    with pytest.raises(ValueError, match="KV cache is"):
        TPModel(cfg, 0, 1).forward(weights, KVCache(cfg, 2, 4, 1), Batch([[1, 2]], [0], [[0]]))
