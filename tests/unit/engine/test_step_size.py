"""A step message must fit the NATS server's max_payload: its publish fails otherwise, and
every request in the step with it. What makes one large is the sample specs, which carry a
request's bad_words, allowed ids and logit_bias once per choice."""

from __future__ import annotations

import msgspec

from services.engine.scheduler import Scheduler
from shared import messages as m
from tests.unit.engine.test_scheduler import fake_reply

MAX_PAYLOAD = 1 << 20  # nats-server's default
# 256 sequences of 64 tokens (ids past 127: two msgpack bytes each), as the API tokenizes
# 128 bad_words of 32 two-byte characters (each alone and after a space): about 33 KB in
# every sample spec of the request
WORDS = [[195, 169] * 31 + [200 + i % 50, 250 + i // 50] for i in range(256)]


def heavy(rid: str, n: int) -> m.GenRequest:
    return m.GenRequest(rid, [1, 2, 3], 4, n=n, bad_words=WORDS)


def specs_bytes(step: m.StepRequest) -> int:
    return sum(len(msgspec.msgpack.encode(s)) for row in step.rows for s in row.sample)


def test_a_request_whose_choices_would_not_fit_one_step_is_refused_naming_the_field() -> None:
    """Its prefill row carries a spec per choice: n=64 of these is 2 MB, a step that can
    never be sent (it failed the step loop and every live request, 503)."""
    s = Scheduler(256, 4, 64, 2048, max_model_len=64)
    why = s.check(heavy("a", 64))
    assert why is not None and why[1] == "bad_words" and "n (64)" in why[0], why
    assert s.check(heavy("b", 8)) is None
    assert s.check(m.GenRequest("c", [1, 2, 3], 4, n=64)) is None


def test_a_step_carries_at_most_max_spec_bytes_of_sample_specs() -> None:
    """Six requests that each fit share steps without passing the bound (together, 1.6 MB
    in one step before), and every one of them ends."""
    s = Scheduler(256, 4, 64, 2048, max_model_len=64)
    for i in range(6):
        s.add(heavy(f"r{i}", 8), "inbox")
    ended: set[str] = set()
    while s.requests:
        plan = s.schedule()
        assert plan is not None
        assert specs_bytes(plan.step) <= MAX_PAYLOAD // 2  # the default bound
        assert len(msgspec.msgpack.encode(plan.step)) < MAX_PAYLOAD
        outs = s.apply(plan, fake_reply(plan), "v0")
        ended |= {o.seq.req.request_id for o in outs if o.finish_reason}
    assert ended == {f"r{i}" for i in range(6)}
