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


# A long context in small KV blocks: every row carries its sequence's whole block table, a
# block id per token here (up to 3 msgpack bytes each), and n choices are n rows
SMALL = 32 * 1024  # a server's max_payload


def long_context() -> Scheduler:
    s = Scheduler(16384, 1, 64, 2048, max_model_len=16384)
    s.fit(SMALL)
    return s


def test_block_tables_count_against_the_step_message() -> None:
    """n=16 choices of a 1000-token prompt decode as 16 rows of 1000 block ids (~2.7 KB
    each): one step of them is 43 KB, past a 32 KiB max_payload (its publish failed, and
    every live request with it, 503). Now the rows share steps within the bound, and every
    choice ends."""
    s = long_context()
    assert s.check(m.GenRequest("a", list(range(1000)), 4, n=16)) is None
    s.add(m.GenRequest("a", list(range(1000)), 4, n=16), "inbox")
    s.add(m.GenRequest("b", [1, 2, 3], 4), "inbox")
    ended: set[tuple[str, int]] = set()
    steps = 0
    while s.requests:
        plan = s.schedule()
        assert plan is not None
        size = len(msgspec.msgpack.encode(plan.step))
        assert size <= SMALL - 2048, (plan.step.step, size, len(plan.step.rows))
        outs = s.apply(plan, fake_reply(plan), "v0")
        ended |= {(o.seq.req.request_id, o.seq.index) for o in outs if o.finish_reason}
        steps += 1
        assert steps < 100
    assert ended == {("a", i) for i in range(16)} | {("b", 0)}


def test_a_request_whose_row_alone_would_not_fit_a_step_is_refused_naming_the_cause() -> None:
    """A row that fits no step message could never be sent: a 400 at admission naming the
    field that makes its block table that long, and the block table in its message."""
    s = long_context()
    why = s.check(m.GenRequest("a", list(range(12000)), 4))  # 36 KB of block ids
    assert why is not None and why[1] == "prompt" and "block table" in why[0], why
    why = s.check(m.GenRequest("a", list(range(1000)), 11000))  # its last rows: 36 KB
    assert why is not None and why[1] == "max_tokens" and "block table" in why[0], why
    assert s.check(m.GenRequest("a", list(range(1000)), 3000)) is None


def test_a_request_waiting_for_room_in_the_step_is_not_overtaken() -> None:
    """``a`` decodes 8 rows of 1000 block ids (24 KB); ``b``'s first row (8 KB) does not fit
    beside them and waits. Small requests arriving every step do fit: started before ``b``,
    a stream of them kept it waiting as long as they came. Now none queued behind ``b``
    starts before it."""
    s = long_context()
    s.add(m.GenRequest("a", list(range(1000)), 6, n=8), "inbox")
    plan = s.schedule()  # its prefill: its 8 choices fork
    assert plan is not None
    s.apply(plan, fake_reply(plan), "v0")
    s.add(m.GenRequest("b", list(range(1000)), 2), "inbox")
    started = ["a"]
    for i in range(40):
        s.add(m.GenRequest(f"s{i}", [1, 2, 3], 2), "inbox")
        plan = s.schedule()
        if plan is None:
            break
        assert len(msgspec.msgpack.encode(plan.step)) <= SMALL - 2048
        for seq in plan.seqs:
            rid = seq.req.request_id
            if rid not in started:
                started.append(rid)
        s.apply(plan, fake_reply(plan), "v0")
    assert "b" in started, started
    assert started.index("b") == 1, started  # right after "a", before every small one


def test_finished_ids_past_the_bound_go_with_later_steps() -> None:
    """A pause that aborts ends every live choice at once: their ids go with the next step
    for rank 0 to forget. 12000 of them (three bytes each) are 36 KB, past a 32 KiB message;
    an eighth of the message goes per step, the rest with the next ones."""
    s = long_context()
    for i in range(4):
        s.add(m.GenRequest(f"a{i}", [1, 2, 3], 4, n=3000), "inbox")
    assert len(s.abort()) == 12000
    s.add(m.GenRequest("b", [1, 2, 3], 40), "inbox")
    forgotten: list[int] = []
    while s.requests:
        plan = s.schedule()
        assert plan is not None
        assert len(msgspec.msgpack.encode(plan.step)) <= SMALL - 2048
        forgotten += plan.step.finished
        s.apply(plan, fake_reply(plan), "v0")
    assert sorted(forgotten) == list(range(12000))  # ("b"'s own goes with the next step)
