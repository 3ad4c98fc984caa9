"""Rank 0's reply to a step must fit the NATS server's max_payload as its step message
does: past it the reply is not published and every request in the step fails (503).
Each sample takes its seq id, token, logprob and, with ``top_logprobs``, up to 20
alternatives: a one-iteration step of many choices asking them is what passes it."""

from __future__ import annotations

from services.engine.scheduler import Scheduler
from shared import messages as m
from tests.unit.engine.test_scheduler import fake_reply

PAYLOAD = 32 * 1024  # tests/e2e/test_decode_steps_reply.py's server


def small() -> Scheduler:
    s = Scheduler(4096, 4, 256, 2048, max_model_len=256)
    s.fit(PAYLOAD)
    return s


def widest_reply(step: m.StepRequest, top: int) -> int:
    """The largest reply rank 0 may give ``step``: every id at its widest."""
    n = sum(len(row.sample) for row in step.rows) * step.iters
    wide = 2**31 - 1
    alts = [m.TopLogprobs([wide] * top, bytes(4 * top)) for _ in range(n)]
    reply = m.StepReply(step.step, [wide] * n, [wide] * n, [-0.1] * n, seconds=0.25, top=alts)
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
