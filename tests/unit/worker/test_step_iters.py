"""A rank's step of several decode iterations (``StepRequest.iters``): what the same
one-token steps give, sample for sample (seeded draws, penalties, logprobs, top
alternatives), each iteration fed the token the one before sampled."""

from __future__ import annotations

import pytest

from services.worker.stepper import Stepper
from shared import messages as m
from tests.unit.worker.test_step_keep import stepper

PROMPT = [3, 4, 5]


def spec(seq: int) -> m.SamplingSpec:
    return m.SamplingSpec(
        seq, temperature=1.0, seed=11, salt=seq, logprobs=True, top_logprobs=2,
        logit_bias=m.LogitBias([2], [1.5]), penalties=m.Penalties(0.3, 0.2, 1.3, len(PROMPT)),
    )  # fmt: skip


def row(seq: int, toks: list[int], pos: int) -> m.StepRow:
    return m.StepRow(seq, toks, pos, [0], [spec(seq)], history=True)


def samples(reply: m.StepReply) -> list[tuple[int, int, float, list[int], bytes]]:
    return [
        (s, t, lp, top.ids, top.packed)
        for s, t, lp, top in zip(
            reply.seq_ids, reply.tokens, reply.logprobs, reply.top, strict=True
        )
    ]


def one_at_a_time(k: int) -> list[tuple[int, int, float, list[int], bytes]]:
    st, _ = stepper()
    first = st.run(m.StepRequest(1, [row(0, PROMPT, 0), row(1, [9, 1, 2], 0)]))
    out = samples(first)
    last = dict(zip(first.seq_ids, first.tokens, strict=True))
    pos = {0: len(PROMPT), 1: 3}
    for i in range(k):
        rep = st.run(m.StepRequest(2 + i, [row(s, [last[s]], pos[s]) for s in (0, 1)]))
        out += samples(rep)
        last = dict(zip(rep.seq_ids, rep.tokens, strict=True))
        pos = {s: p + 1 for s, p in pos.items()}
    return out


@pytest.mark.parametrize("keep", [False, True])
def test_k_iterations_sample_what_k_steps_sample(keep: bool) -> None:
    st, model = stepper()
    first = st.run(m.StepRequest(1, [row(0, PROMPT, 0), row(1, [9, 1, 2], 0)]))
    last = dict(zip(first.seq_ids, first.tokens, strict=True))
    rows = [row(0, [last[0]], len(PROMPT)), row(1, [last[1]], 3)]
    rep = st.run(m.StepRequest(2, rows, keep=keep, iters=4))
    assert len(rep.seq_ids) == 8 and not rep.failed
    assert samples(first) + samples(rep) == one_at_a_time(4)
    # each iteration after the first was fed the tokens the one before sampled
    got = list(zip(rep.seq_ids, rep.tokens, strict=True))
    assert model.fed[2] == [[got[0][1]], [got[1][1]]]
    # the last iteration's tokens are kept for a ``prev`` row of the next step
    assert st.kept == ({0: got[-2][1], 1: got[-1][1]} if keep else {})


class Failing(Stepper):
    def _sample(self, *args: object, **kw: object) -> object:  # type: ignore[override]
        raise RuntimeError("sampling broke")


def test_rank_0_failing_stops_every_rank_after_that_iteration() -> None:
    """Rank 0's sampling raising in iteration 0 rides the token share; a peer rank stops
    there too instead of entering iteration 1's collectives alone."""
    for rank in (0, 1):
        st, model = stepper()
        st.rank = rank
        if rank == 0:
            st.__class__ = Failing
        else:  # rank 0's flag arrives in the share
            model.share_tokens = lambda toks: [*toks[:-1], 1]  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            st.run(m.StepRequest(1, [row(0, [1], 0)], iters=3))
        assert len(model.fed) == 1, rank


def test_each_iteration_is_progress_for_the_watchdog() -> None:
    """A rank's hang bound (and the engine's "compute thread stuck in step" check) reads
    ``busy_s``: it counts from the start of the step's current decode iteration."""
    st, model = stepper()
    starts: list[float] = []
    forward = model.forward

    def timed(*args: object) -> object:
        starts.append(st.watermark.since)
        return forward(*args)

    model.forward = timed  # type: ignore[method-assign]
    st.watermark.run("step 1", st.run, m.StepRequest(1, [row(0, [1, 2, 3], 0)], iters=3))
    assert len(starts) == 3 and starts[0] < starts[1] < starts[2]
