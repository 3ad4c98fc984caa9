"""services.worker.sampling: ``logit_bias`` is added to the logits before greedy,
temperature, top-k and top-p, and the reported logprobs are those of the biased
distribution; without a bias nothing changes, bit for bit."""

from __future__ import annotations

from functools import partial

import msgspec
import numpy as np
import pytest

from services.worker.sampling import SamplingParams, make_generator, sample, sample_each
from shared import messages as m
from tests.unit.worker.test_sampling import gens, log_softmax
from tests.unit.worker.test_sampling import logits as random_logits

logits = partial(random_logits, vocab=64)


def test_plus_100_makes_greedy_pick_the_token_and_logprob_is_the_biased_one() -> None:
    x = logits()
    target = [int(np.argmin(r)) for r in x]  # the least likely token of each row
    params = [SamplingParams(temperature=0, bias_ids=[t], bias_values=[100.0]) for t in target]
    toks, lps = sample(x, params, gens(4))
    assert toks == target
    biased = x.astype(np.float64)
    biased[np.arange(4), target] += 100.0
    np.testing.assert_allclose(lps, log_softmax(biased)[np.arange(4), target], atol=1e-9)
    assert all(lp > -1e-3 for lp in lps)  # the biased distribution, not the raw one


def test_minus_100_bans_the_top_token_greedy_and_sampled() -> None:
    x = logits(n=1)
    order = np.argsort(-x[0])
    top, second = int(order[0]), int(order[1])
    x[0, top] = x[0, second] + 20.0  # the top token is near-certain without the bias
    ban = SamplingParams(temperature=0, bias_ids=[top], bias_values=[-100.0])
    assert sample(x, [ban], gens(1))[0] == [second]
    hot = SamplingParams(temperature=1.0, seed=1, bias_ids=[top], bias_values=[-100.0])
    g = make_generator(1, 0)
    drawn = {sample(x, [hot], [g])[0][0] for _ in range(300)}
    assert top not in drawn and len(drawn) > 3


def test_sampled_rows_respect_a_positive_bias_through_top_k_and_top_p() -> None:
    x = logits(n=1, vocab=200)
    t = int(np.argmin(x[0]))
    for kw in ({}, {"top_k": 3}, {"top_p": 0.5}, {"temperature": 2.0}):
        p = SamplingParams(seed=5, bias_ids=[t, 0], bias_values=[100.0, -3.5], **kw)
        g = make_generator(5, 0)
        assert {sample(x, [p], [g])[0][0] for _ in range(50)} == {t}, kw


def test_top_logprobs_are_of_the_biased_distribution() -> None:
    x = logits(n=1)
    t = int(np.argmin(x[0]))
    p = SamplingParams(temperature=0, top_logprobs=3, bias_ids=[t], bias_values=[100.0])
    (res,) = sample_each(x, [p], gens(1))
    assert not isinstance(res, Exception) and res.top is not None
    assert int(res.top[0][0]) == t and res.top[1][0] == np.float32(res.logprob)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0},
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "top_logprobs": 4},
    ],
)
def test_no_bias_is_bit_for_bit_the_same(kw: dict[str, float]) -> None:
    x = logits(n=6, vocab=500)
    plain = sample_each(x, [SamplingParams(seed=9, **kw)] * 6, gens(6, 9))
    empty = SamplingParams(seed=9, bias_ids=[], bias_values=[], **kw)
    again = sample_each(x, [empty] * 6, gens(6, 9))
    zero = SamplingParams(seed=9, bias_ids=[3], bias_values=[0.0], **kw)
    zeroed = sample_each(x, [zero] * 6, gens(6, 9))
    for a, b, c in zip(plain, again, zeroed, strict=True):
        assert not isinstance(a, Exception)
        assert (a.token, a.logprob) == (b.token, b.logprob) == (c.token, c.logprob)
        if a.top is not None:
            assert a.top[0].tobytes() == b.top[0].tobytes()
            assert a.top[1].tobytes() == b.top[1].tobytes()


def test_the_callers_row_is_not_modified() -> None:
    x = logits(n=1).astype(np.float64)
    before = x.copy()
    sample_each(x, [SamplingParams(temperature=0, bias_ids=[1], bias_values=[50.0])], gens(1))
    assert x.tobytes() == before.tobytes()


@pytest.mark.parametrize(
    ("ids", "values"),
    [([1, 2], [1.0]), ([1, 1], [1.0, 2.0]), ([-1], [1.0]), ([1], [float("nan")])],
)
def test_bad_bias_rejected(ids: list[int], values: list[float]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(bias_ids=ids, bias_values=values)


def test_an_id_beyond_the_logits_fails_its_row_only() -> None:
    x = logits(n=2)
    bad = SamplingParams(temperature=0, bias_ids=[x.shape[1]], bias_values=[1.0])
    res = sample_each(x, [bad, SamplingParams(temperature=0)], gens(2))
    assert isinstance(res[0], ValueError) and "logit_bias" in str(res[0])
    assert not isinstance(res[1], Exception) and res[1].token == int(np.argmax(x[1]))


def test_sampling_spec_without_the_bias_field_still_decodes() -> None:
    old = msgspec.msgpack.encode([5, 0.0, 1.0, 0, None, 0, False, 0])  # before logit_bias
    spec = msgspec.msgpack.decode(old, type=m.SamplingSpec)
    assert spec.seq_id == 5 and spec.logit_bias is None
    new = m.SamplingSpec(5, logit_bias=m.LogitBias([3, 9], [100.0, -1.5]))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=m.SamplingSpec)
    assert back.logit_bias == m.LogitBias([3, 9], [100.0, -1.5])
    # no bias, no ban (min_tokens), no penalties and no limits (min_p, allowed_token_ids)
    # cost one nil byte each per spec
    assert len(msgspec.msgpack.encode(m.SamplingSpec(5))) == len(old) + 4


def test_the_rank_applies_the_step_rows_bias_and_fails_a_bad_one_alone() -> None:
    from tests.unit.worker.test_step_keep import stepper

    st, _ = stepper()  # greedy picks (last token + 1) % 16 without a bias

    def spec(seq: int, bias: m.LogitBias | None) -> m.StepRow:
        return m.StepRow(seq, [3], 0, [0], [m.SamplingSpec(seq, temperature=0.0, logit_bias=bias)])

    reply = st.run(
        m.StepRequest(1, [
            spec(0, m.LogitBias([9], [100.0])),
            spec(1, m.LogitBias([4], [-100.0])),
            spec(2, None),
            spec(3, m.LogitBias([16], [1.0])),  # beyond the logits: its sequence fails alone
        ])
    )  # fmt: skip
    assert dict(zip(reply.seq_ids, reply.tokens, strict=True)) == {0: 9, 1: 0, 2: 4}
    assert [(f[0], f[1]) for f in reply.failed] == [(3, 400)]
