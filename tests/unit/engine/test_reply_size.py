"""Rank 0's reply to a step must fit the NATS server's max_payload as its step message
does: past it the reply is not published and every request in the step fails (503).
Each sample takes its seq id, token, logprob and, with ``top_logprobs``, up to 20
alternatives: a one-iteration step of many choices asking them is what passes it."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.engine.scheduler import Scheduler, reply_bytes
from shared import messages as m
from tests.unit.engine.test_scheduler import fake_reply

PAYLOAD = 32 * 1024  # tests/e2e/test_decode_steps_reply.py's server
# a StepReply's own fields: fixarray header, step (uint64), error (""), seconds (float64),
# ``failed`` (empty here: a quarter of the message is kept for it) and the four lists'
# headers at their widest (array32)
HEADER = 1 + 9 + 1 + 9 + 1 + 4 * 5


def small() -> Scheduler:
    s = Scheduler(4096, 4, 256, 2048, max_model_len=256)
    s.fit(PAYLOAD)
    return s


def widest_reply(step: m.StepRequest, top: int) -> int:
    """The largest reply rank 0 may give ``step``: every id at its widest (its seq ids
    at least those of 2**31 sequences)."""
    wide = 2**31 - 1
    ids = [max(spec.seq_id, wide) for row in step.rows for spec in row.sample] * step.iters
    n = len(ids)
    alts = [m.TopLogprobs([wide] * top, bytes(4 * top)) for _ in range(n)]
    reply = m.StepReply(step.step, ids, [wide] * n, [-0.1] * n, seconds=0.25, top=alts)
    return len(m.pack(reply))


def gen(rid: str, n: int, top: int = 20) -> m.GenRequest:
    return m.GenRequest(rid, [1, 2, 3], 4, n=n, logprobs=True, top_logprobs=top, seed=1)


def test_a_request_whose_choices_top_alternatives_would_not_fit_a_reply_is_refused() -> None:
    """Its prefill row samples all n choices in one reply: 128 x 20 alternatives is up to
    26 KB, past the 23 KB of samples a 32 KiB reply holds."""
    s = small()
    why = s.check(gen("a", 128))
    assert why is not None and why[1] == "top_logprobs" and "n (128)" in why[0], why
    assert s.check(gen("b", 100)) is None
    assert s.check(gen("c", 128, top=0)) is None


def test_a_step_reply_of_many_choices_with_alternatives_fits_max_payload() -> None:
    """Four requests of 100 choices asking 20 alternatives each: their rows share steps
    whose reply always fits (two prefill rows, or 200+ decode rows, were one step's up
    to 45 KB before), every request ends, and they start in the order they came."""
    s = small()
    for i in range(4):
        s.add(gen(f"r{i}", 100), "inbox")
    ended: set[str] = set()
    started: list[str] = []
    while s.requests:
        plan = s.schedule()
        assert plan is not None
        assert widest_reply(plan.step, 20) <= PAYLOAD
        for seq in plan.seqs:
            if seq.req.request_id not in started:
                started.append(seq.req.request_id)
        outs = s.apply(plan, fake_reply(plan), "v0")
        ended |= {o.seq.req.request_id for o in outs if o.finish_reason}
    assert ended == {f"r{i}" for i in range(4)}
    assert started == [f"r{i}" for i in range(4)]


def test_seq_ids_past_2_32_count_in_the_reply_budget() -> None:
    """An engine that has made 2**32 sequences sends uint64 seq ids (9 bytes, not 5): the
    samples a step plans stay within ``max_reply_bytes`` (112 decode rows of 20
    alternatives were 23.4 KB of a 23 KB room), and a request of 111 such choices
    (23.2 KB) is refused as its prefill row could not fit."""
    s = small()
    assert s.check(gen("x", 111)) is None
    s._next_seq = 2**40  # as after 2**40 sequences (not a count a test can make)
    why = s.check(gen("x", 111))
    assert why is not None and why[1] == "top_logprobs", why
    for i in range(30):  # small requests: their decode rows share steps, 112 a step
        s.add(gen(f"r{i}", 8), "inbox")
    while s.requests:
        plan = s.schedule()
        assert plan is not None
        assert widest_reply(plan.step, 20) - HEADER <= s.max_reply_bytes
        s.apply(plan, fake_reply(plan), "v0")


@st.composite
def samples(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, float, int]]]:
    """(the engine's next seq id, samples of (seq id, token, logprob, alternatives))."""
    next_seq = draw(st.sampled_from([1, 2**16, 2**32 - 1, 2**32, 2**40, 2**63 - 1]))
    top = draw(st.lists(st.integers(0, m.MAX_TOP_LOGPROBS), min_size=1, max_size=3))
    drawn = draw(
        st.lists(
            st.tuples(
                st.integers(0, next_seq - 1),
                st.integers(0, m.TOKEN_LIMIT),
                st.floats(allow_nan=False, width=64),
                st.sampled_from(top),
            ),
            min_size=1,
            max_size=300,
        )
    )
    return next_seq, drawn


@settings(max_examples=300, deadline=None)
@given(samples())
@example((2**63 - 1, [(2**63 - 2, m.TOKEN_LIMIT, -0.1, 20)] * 200))
@example((2**32 - 1, [(2**32 - 2, m.TOKEN_LIMIT, -0.1, 20)] * 200))  # was 2 bytes over each
@example((2**32 - 1, [(2**32 - 2, m.TOKEN_LIMIT, -0.1, 16)] * 200))
def test_reply_bytes_bound_a_packed_step_reply(drawn: tuple[int, list]) -> None:
    """Property: a real StepReply of any samples (seq ids below the scheduler's next one,
    any token of a 2**31 vocabulary, any float64, 0..20 alternatives of the widest ids,
    mixed: an empty ``top`` entry for a sample that asked none) packs within its header
    plus ``reply_bytes`` per sample — what the planner counts against ``max_reply_bytes``."""
    next_seq, rows = drawn
    top = [
        m.TopLogprobs([m.TOKEN_LIMIT] * k, bytes(4 * k)) for _, _, _, k in rows
    ] if any(k for *_, k in rows) else []  # fmt: skip
    reply = m.StepReply(
        2**64 - 1,
        [s for s, *_ in rows],
        [t for _, t, _, _ in rows],
        [lp for _, _, lp, _ in rows],
        seconds=0.25,
        top=top,
    )
    bound = HEADER + sum(reply_bytes(k, next_seq) for *_, k in rows)
    assert len(m.pack(reply)) <= bound
