"""services.worker.sampling: greedy, seeded reproducibility, top-k/top-p, logprobs and
top_logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.sampling import (
    Sampled,
    SamplingParams,
    make_generator,
    sample,
    sample_each,
    top_logprobs,
)
from shared.messages import MAX_TOP_LOGPROBS


def logits(n: int = 4, vocab: int = 50, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (n, vocab)).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def gens(n: int, seed: int | None = 7) -> list[np.random.Generator]:
    return [make_generator(seed, i) for i in range(n)]


def test_greedy_is_argmax_with_log_softmax_logprob() -> None:
    x = logits()
    toks, lps = sample(x, [SamplingParams(temperature=0)] * 4, gens(4))
    assert toks == list(np.argmax(x, axis=-1))
    want = log_softmax(x)[np.arange(4), toks]
    np.testing.assert_allclose(lps, want, atol=1e-6)


def test_seeded_sampling_is_reproducible_and_salted() -> None:
    x = np.zeros((1, 1000), np.float32)  # uniform: every draw is informative
    p = [SamplingParams(temperature=1.0, seed=3)]
    runs = [
        [sample(x, p, [g])[0][0] for _ in range(20)]
        for g in (make_generator(3, 0), make_generator(3, 0), make_generator(3, 1))
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len(set(runs[0])) > 10  # actually random, not stuck


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=5, top_p=1e-9),
    ],
)
def test_truncation_to_one_token_equals_greedy(params: SamplingParams) -> None:
    x = logits(n=6, seed=1)
    greedy, _ = sample(x, [SamplingParams(temperature=0)] * 6, gens(6))
    for seed in range(5):
        toks, _ = sample(x, [params] * 6, gens(6, seed))
        assert toks == greedy


def test_ties_resolve_to_lowest_id() -> None:
    x = np.array([[0.0, 2.0, 2.0, 1.0]], np.float32)
    assert sample(x, [SamplingParams(temperature=0)], gens(1))[0] == [1]
    assert sample(x, [SamplingParams(top_k=1)], gens(1))[0] == [1]
    assert sample(x, [SamplingParams(top_p=1e-6)], gens(1))[0] == [1]


def test_top_k_and_top_p_restrict_support() -> None:
    x = logits(n=1, vocab=100, seed=2)
    order = np.argsort(-x[0])
    seen_k = {sample(x, [SamplingParams(top_k=3)], [g])[0][0] for g in gens(200, 1)}
    assert seen_k <= set(order[:3].tolist()) and len(seen_k) > 1
    probs = np.exp(log_softmax(x)[0][order])
    nucleus = int(np.searchsorted(np.cumsum(probs), 0.5)) + 1
    seen_p = {sample(x, [SamplingParams(top_p=0.5)], [g])[0][0] for g in gens(300, 2)}
    assert seen_p <= set(order[:nucleus].tolist())


def test_logprobs_are_raw_whatever_the_sampling_parameters() -> None:
    """vLLM's default (raw_logprobs): the model's log_softmax, before temperature and
    top-k/top-p; the sampler still draws from the tempered, truncated distribution."""
    x = logits(n=3, seed=4)
    params = [SamplingParams(temperature=t, top_k=k) for t, k in ((0.5, 0), (1.0, 10), (2.0, 0))]
    toks, lps = sample(x, params, gens(3))
    assert all(lp <= 0 for lp in lps)
    for row in range(3):
        assert lps[row] == pytest.approx(log_softmax(x[row])[toks[row]], abs=1e-9)
    assert log_softmax(x[0] / 0.5)[toks[0]] != pytest.approx(lps[0], abs=1e-3)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(0.7, 0.9, 5)])
def test_top_logprobs_are_the_k_largest_of_the_raw_log_softmax(params: SamplingParams) -> None:
    x = logits(n=2, vocab=300, seed=5)
    params = SamplingParams(
        params.temperature, params.top_p, params.top_k, top_logprobs=MAX_TOP_LOGPROBS
    )
    out = sample_each(x, [params, params], gens(2))
    for row, res in enumerate(out):
        assert isinstance(res, Sampled) and res.top is not None
        ids, vals = res.top
        want = log_softmax(x[row].astype(np.float64))
        assert ids.tolist() == np.argsort(-want, kind="stable")[:MAX_TOP_LOGPROBS].tolist()
        assert vals.dtype == np.float32
        np.testing.assert_allclose(vals, want[ids], atol=1e-6)
        assert res.logprob == pytest.approx(want[res.token], abs=1e-12)


def test_top_logprobs_ties_go_to_the_lowest_id_and_k_is_capped_by_the_vocab() -> None:
    x = np.array([[1.0, 3.0, 3.0, 0.0, 3.0]])
    ids, vals = top_logprobs(log_softmax(x[0]), 2)
    assert ids.tolist() == [1, 2] and vals[0] == vals[1]
    res = sample_each(x, [SamplingParams(temperature=0, top_logprobs=9)], gens(1))[0]
    assert isinstance(res, Sampled) and res.top is not None
    assert res.top[0].tolist() == [1, 2, 4, 0, 3]
    assert sample_each(x, [SamplingParams(temperature=0)], gens(1))[0].top is None  # type: ignore[union-attr]


def test_sampling_follows_distribution() -> None:
    x = np.log(np.array([[0.7, 0.2, 0.1]], np.float32))
    g = make_generator(11, 0)
    counts = (
        np.bincount([sample(x, [SamplingParams()], [g])[0][0] for _ in range(4000)], minlength=3)
        / 4000
    )
    np.testing.assert_allclose(counts, [0.7, 0.2, 0.1], atol=0.03)


def test_unseeded_generators_differ() -> None:
    x = np.zeros((1, 10_000), np.float32)
    a = [sample(x, [SamplingParams()], [g])[0][0] for g in gens(5, None)]
    assert len(set(a)) > 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"temperature": float("nan")},
        {"top_logprobs": -1},
        {"top_logprobs": MAX_TOP_LOGPROBS + 1},
    ],
)
def test_invalid_params_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_row_count_mismatch_rejected() -> None:
    with pytest.raises(ValueError):
        sample(logits(n=2), [SamplingParams()], gens(2))


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-45, 1e-30])
def test_a_tiny_temperature_is_greedy_never_a_nan_token(temperature: float) -> None:
    x = logits(n=6, seed=2)
    greedy, _ = sample(x, [SamplingParams(temperature=0)] * 6, gens(6))
    for seed in range(3):
        toks, lps = sample(x, [SamplingParams(temperature=temperature)] * 6, gens(6, seed))
        assert toks == greedy
        assert all(np.isfinite(lps))
