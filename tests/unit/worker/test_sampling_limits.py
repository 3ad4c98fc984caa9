"""services.worker.sampling: vLLM's ``allowed_token_ids`` (every other id's logit -inf,
greedy and sampled alike; the reported logprobs are of that masked distribution) and
``min_p`` (after temperature, before top-k / top-p — vLLM's sampler order: a token less
probable than min_p times the most probable one is never drawn)."""

from __future__ import annotations

import math

import msgspec
import numpy as np

from services.worker.sampling import (
    SamplingParams,
    apply_min_p,
    bad_word_bans,
    make_generator,
    sample,
    sample_each,
)
from shared import messages as m
from tests.unit.worker.test_sampling import gens, log_softmax, logits


def draws(x: np.ndarray, p: SamplingParams, n: int = 400) -> set[int]:
    """Every token ``n`` seeded draws of one row give."""
    gen = make_generator(3, 0)
    return {sample(x, [p], [gen])[0][0] for _ in range(n)}


def test_allowed_ids_only_ever_yield_those_ids() -> None:
    x = logits(n=1, vocab=64)
    allowed = [int(i) for i in np.argsort(x[0])[:2]]  # the two least likely tokens
    got = draws(x, SamplingParams(temperature=1.0, allowed_ids=allowed))
    assert got == set(allowed)  # both drawn, nothing else
    greedy = SamplingParams(temperature=0, allowed_ids=allowed, logprobs=True, top_logprobs=3)
    res = sample_each(x, [greedy], gens(1))[0]
    assert not isinstance(res, Exception)
    best = max(allowed, key=lambda t: x[0, t])
    masked = np.full(64, -np.inf)
    masked[allowed] = x[0, allowed]
    assert res.token == best
    assert abs(res.logprob - log_softmax(masked[None])[0, best]) < 1e-9  # over the allowed
    assert res.top is not None and sorted(res.top[0][:2].tolist()) == sorted(allowed)


def test_without_allowed_ids_or_min_p_nothing_changes() -> None:
    x = logits()
    plain = [SamplingParams(temperature=0.8, seed=1) for _ in range(4)]
    same = [SamplingParams(temperature=0.8, seed=1, min_p=0.0, allowed_ids=()) for _ in range(4)]
    assert sample(x, plain, gens(4)) == sample(x, same, gens(4))


def test_a_bad_allowed_id_or_an_all_banned_mask_fails_only_its_row() -> None:
    x = logits(n=3, vocab=16)
    ps = [
        SamplingParams(temperature=0, allowed_ids=[3, 99]),  # beyond the logits
        SamplingParams(temperature=0, allowed_ids=[5], ban_ids=[5]),  # min_tokens bans it
        SamplingParams(temperature=0, allowed_ids=[4]),
    ]
    res = sample_each(x, ps, gens(3))
    assert isinstance(res[0], ValueError) and "allowed_token_ids" in str(res[0])
    assert isinstance(res[1], ValueError) and "banned" in str(res[1])
    assert not isinstance(res[2], Exception) and res[2].token == 4


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability() -> None:
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    x = np.log(probs)[None]
    assert draws(x, SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1, 2}  # >= 0.12
    assert draws(x, SamplingParams(temperature=1.0, min_p=0.999)) == {0}  # the greedy one
    # after temperature: at T = 2 the probabilities flatten (ratio sqrt), 0.1 now passes
    # 0.45 x top (sqrt(0.1 / 0.4) = 0.5) and 0.06 (0.39) does not
    assert draws(x, SamplingParams(temperature=2.0, min_p=0.45)) == {0, 1, 2, 3}
    assert draws(x, SamplingParams(temperature=0, min_p=0.999)) == {0}  # greedy: no effect


def test_min_p_comes_before_top_p() -> None:
    """vLLM's order: min_p drops token 3, then top-p over the renormalised survivors
    (0.5, 0.22, 0.18)/0.9 keeps two (0.556 + 0.244 >= 0.75). top-p first would keep three
    (0.5 + 0.22 < 0.75) and min_p after it none more."""
    x = np.log(np.array([0.5, 0.22, 0.18, 0.1]))[None]
    assert draws(x, SamplingParams(temperature=1.0, top_p=0.75)) == {0, 1, 2}
    assert draws(x, SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3)) == {0, 1}


def test_apply_min_p_is_the_ratio_test() -> None:
    logp = log_softmax(logits(n=1, vocab=200))[0]
    for mp in (0.01, 0.2, 0.9, 1.0):
        got = apply_min_p(logp, mp)
        keep = np.exp(logp) >= mp * np.exp(logp).max() * (1 - 1e-12)
        assert np.array_equal(np.isfinite(got), keep)
        np.testing.assert_array_equal(got[keep], logp[keep])
    assert math.isfinite(apply_min_p(logp, 1e-300).min())  # tiny: nothing dropped


def test_the_spec_carries_them_only_when_asked() -> None:
    """A spec without them is unchanged on the wire but for one nil byte; with them they
    round-trip."""
    enc = msgspec.msgpack.Encoder()
    plain = m.SamplingSpec(1)
    assert msgspec.msgpack.decode(enc.encode(plain), type=m.SamplingSpec).limits is None
    spec = m.SamplingSpec(1, limits=m.Limits(0.1, [4, 2]))
    back = msgspec.msgpack.decode(enc.encode(spec), type=m.SamplingSpec)
    assert back.limits == m.Limits(0.1, [4, 2])


def test_allowed_ids_hold_on_a_penalised_row() -> None:
    """A penalised row is prepared before its penalties (one gather for all such rows):
    the mask holds there too, and a penalty on a masked id keeps it -inf."""
    x = logits(n=1, vocab=32)
    top = int(np.argmax(x[0]))
    allowed = [int(i) for i in np.argsort(x[0])[:3]]
    p = SamplingParams(
        temperature=1.0, allowed_ids=allowed, presence_penalty=-2.0, repetition_penalty=0.5,
        seen_ids=[top, allowed[0]], output_counts=[3.0, 1.0],
    )  # fmt: skip
    assert draws(x, p) <= set(allowed)


def test_bad_word_bans_the_last_token_after_the_others() -> None:
    """vLLM's ``apply_bad_words``: a word of k+1 tokens bans its last one when the output
    ends with its first k (and never before the output has k tokens)."""
    words = [[5, 6], [1, 2, 3], [9, 9]]
    assert bad_word_bans(words, []) == []
    assert bad_word_bans(words, [4, 5]) == [6]
    assert bad_word_bans(words, [1, 2]) == [3]
    assert bad_word_bans(words, [2]) == []  # [1, 2] not complete
    assert bad_word_bans(words, [9]) == [9]
    assert bad_word_bans(words, [5, 9]) == [9]


def test_the_rank_bans_a_bad_word_with_the_token_in_flight() -> None:
    """The engine's tail lacks the token a step in flight sampled (``prev``): rank 0 adds
    it, so the word completes on the pipelined row too."""
    from services.worker.stepper import Stepper

    row = m.StepRow(1, [5], 10, [0], [], prev=True)
    spec = m.SamplingSpec(1, ban=[2], limits=m.Limits(bad_words=[[4, 7, 8]], tail=[3, 4]))
    assert Stepper._bans(row, spec, [5]) == [2]  # the kept token 5: [3, 4, 5]
    spec.limits = m.Limits(bad_words=[[4, 7, 8]], tail=[4])
    assert Stepper._bans(row, spec, [7]) == [2, 8]
    assert Stepper._bans(m.StepRow(1, [7], 10, [0], []), spec, [7]) == [2]  # no prev: [4]
