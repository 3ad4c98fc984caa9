"""A step message must fit the NATS server's max_payload: its publish fails otherwise, and
every request in the step with it. What makes one large is the sample specs, which carry a
request's bad_words, allowed ids and logit_bias once per choice."""

from __future__ import annotations

import msgspec
import pytest

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


BIG = m.TOKEN_LIMIT - 1  # ids past 2**16: five msgpack bytes each, as a large vocabulary's
STOPS = [BIG - i for i in range(m.MAX_STOP_TOKEN_IDS + 16)]  # the client's + the model's eos
SPECS = {  # a request's sample specs, as _row builds them: none may pass its spec_bytes
    "plain": m.GenRequest("a", [1, 2, 3], 4),
    "min_tokens holds stop ids": m.GenRequest(
        "a", [1, 2, 3], 4, min_tokens=2, stop_token_ids=STOPS
    ),
    "penalties, min_p, logprobs": m.GenRequest(
        "a",
        [1, 2, 3],
        4,
        temperature=0.123456789,
        top_p=0.987654321,
        top_k=BIG,
        seed=m.INT64_MIN,
        logprobs=True,
        top_logprobs=20,
        min_p=0.123456789,
        repetition_penalty=1.123456789,
        frequency_penalty=-1.123456789,
        presence_penalty=1.987654321,
    ),
    "bad_words and stop ids": m.GenRequest(
        "a",
        [1, 2, 3],
        4,
        min_tokens=2,
        stop_token_ids=STOPS,
        bad_words=WORDS[:8],
        repetition_penalty=1.5,
    ),
}


@pytest.mark.parametrize("name", SPECS)
def test_spec_bytes_bounds_every_sample_spec_of_the_request(name: str) -> None:
    """The step budget and the admission bound count spec_bytes per spec: a spec larger
    than it (272 five-byte stop ids held back by min_tokens: 1.4 KB counted as 64 bytes)
    lets a step pass max_payload, its publish fail and every live request with it."""
    s = Scheduler(256, 4, 64, 2048, max_model_len=64)
    req = s.add(SPECS[name], "inbox")
    plan = s.schedule()
    assert plan is not None
    sizes = [len(msgspec.msgpack.encode(sp)) for row in plan.step.rows for sp in row.sample]
    assert sizes and max(sizes) <= req.spec_bytes, (sizes, req.spec_bytes)


def test_stop_ids_held_by_min_tokens_count_against_the_admission_bound() -> None:
    """A server with max_payload 64 KiB: n=64 choices each banning 272 stop ids is 89 KB of
    specs in the prefill row, a step that can never be sent: 400 naming stop_token_ids."""
    s = Scheduler(256, 4, 64, 2048, max_model_len=64)
    s.max_spec_bytes = 32 * 1024
    gen = m.GenRequest("a", [1, 2, 3], 4, n=64, min_tokens=2, stop_token_ids=STOPS)
    why = s.check(gen)
    assert why is not None and why[1] == "stop_token_ids", why

