"""rank 0's ``repetition_penalty`` equals transformers' ``RepetitionPenaltyLogitsProcessor``
on the same logits and ids (prompt + output so far), with presence / frequency penalties
(OpenAI's formula) after it as vLLM orders them: the greedy token, its logprob and the
``top_logprobs`` of the processed distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from services.worker.sampling import SamplingParams, TokenHistory, make_generator, sample_each


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 3.0])
def test_the_sampler_equals_transformers_processor(penalty: float) -> None:
    rng = np.random.default_rng(int(penalty * 10))
    rows, vocab, k = 5, 1000, 5
    x = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    params, want = [], []
    for i in range(rows):
        prompt = rng.integers(0, vocab, 30).tolist()
        output = np.argsort(-x[i])[:4].tolist() * 2 + rng.integers(0, vocab, 6).tolist()
        h = TokenHistory()
        h.record(0, prompt + output)
        seen, counts = h.penalty_view(len(prompt))
        presence, frequency = (0.0, 0.0) if i < 2 else (0.4 * i - 1, 0.3 * i - 1)
        params.append(SamplingParams(
            temperature=0, top_logprobs=k, repetition_penalty=penalty,
            presence_penalty=presence, frequency_penalty=frequency,
            seen_ids=seen, output_counts=counts,
        ))  # fmt: skip
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([prompt + output]), torch.tensor(x[i : i + 1], dtype=torch.float64)
        )[0].numpy()
        c = np.bincount(output, minlength=vocab)
        want.append(theirs - (c * frequency + (c > 0) * presence))
    res = sample_each(x, params, [make_generator(1, i) for i in range(rows)])
    for got, y in zip(res, want, strict=True):
        assert not isinstance(got, Exception), got
        logp = torch.log_softmax(torch.tensor(y), -1).numpy()
        assert got.token == int(np.argmax(y))
        assert abs(got.logprob - logp[got.token]) < 1e-9
        assert got.top is not None
        assert got.top[0].tolist() == np.argsort(-logp, kind="stable")[:k].tolist()
        np.testing.assert_allclose(got.top[1], logp[got.top[0]], atol=1e-6)
