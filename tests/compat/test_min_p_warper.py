"""rank 0's ``min_p`` drops the same tokens as transformers' ``MinPLogitsWarper`` on the
same tempered logits (vLLM applies min_p after temperature, as transformers' warper list
does: temperature, then min_p)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

from services.worker.sampling import apply_min_p


@pytest.mark.parametrize("min_p", [0.02, 0.1, 0.5, 0.95])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_min_p_keeps_what_transformers_keeps(min_p: float, temperature: float) -> None:
    rng = np.random.default_rng(int(min_p * 100 + temperature * 10))
    x = rng.normal(0, 3, (6, 1000))
    ids = torch.zeros((6, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, torch.tensor(x))
    theirs = MinPLogitsWarper(min_p)(ids, scores).numpy()
    for row, want in zip(x, theirs, strict=True):
        tempered = row / temperature
        logp = tempered - np.log(np.exp(tempered - tempered.max()).sum()) - tempered.max()
        ours = apply_min_p(logp, min_p)
        assert np.array_equal(np.isfinite(ours), np.isfinite(want))
