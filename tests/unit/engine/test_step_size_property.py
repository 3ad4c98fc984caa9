"""Property: every step message the scheduler plans fits the server's max_payload, for any
mix of admitted requests (long prompts in small KV blocks, many choices, penalties,
logit_bias, bad_words, stop ids held by min_tokens, allowed ids, logprobs), one step at a
time or one planned ahead of another in flight (rows with ``prev``), with preemption; and
every request ends (a row skipped for lack of room is not skipped for ever)."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.scheduler import Plan, Scheduler
from shared import messages as m

BIG = m.TOKEN_LIMIT  # five msgpack bytes
ids = st.integers(0, BIG)


@st.composite
def requests(draw: st.DrawFn, i: int) -> m.GenRequest:
    length = draw(st.sampled_from([3, 700, 2500]))
    prompt = [draw(ids), *range(length - 1)]
    kw: dict[str, object] = {}
    if draw(st.booleans()):
        kw |= {"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1}
    if draw(st.booleans()):
        bias = list(range(BIG - draw(st.integers(1, 600)), BIG))
        kw["logit_bias"] = m.LogitBias(bias, [1.25] * len(bias))
    if draw(st.booleans()):
        kw |= {"min_tokens": 2, "stop_token_ids": [BIG] * draw(st.integers(0, 272))}
    if draw(st.booleans()):
        kw["bad_words"] = draw(
            st.lists(st.lists(ids, min_size=1, max_size=6), min_size=1, max_size=64)
        )
    if draw(st.booleans()):
        allowed = [BIG] * draw(st.integers(1, 1500))
        kw |= {"allowed_token_ids": allowed, "min_p": 0.1}
    if draw(st.booleans()):
        kw |= {"logprobs": True, "top_logprobs": 5, "seed": m.INT64_MIN, "top_k": BIG}
    return m.GenRequest(
        f"r{i}",
        prompt,
        draw(st.integers(1, 24)),
        n=draw(st.sampled_from([1, 2, 16])),
        temperature=0.3,
        **kw,  # type: ignore[arg-type]
    )


def fake_reply(plan: Plan, token: int) -> m.StepReply:
    seqs = [s.seq_id for row in plan.step.rows for s in row.sample]
    return m.StepReply(plan.step.step, seqs, [token] * len(seqs), [-0.5] * len(seqs))


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    max_payload=st.sampled_from([16 * 1024, 32 * 1024, 64 * 1024]),
    block_size=st.sampled_from([1, 2, 16]),
    num_blocks=st.sampled_from([3000, 70000]),
    max_batch=st.sampled_from([4, 64, 256]),
    step_tokens=st.sampled_from([64, 2048]),
    pipelined=st.booleans(),
)
def test_every_step_fits_max_payload_and_every_request_ends(
    data: st.DataObject,
    max_payload: int,
    block_size: int,
    num_blocks: int,
    max_batch: int,
    step_tokens: int,
    pipelined: bool,
) -> None:
    s = Scheduler(num_blocks, block_size, max_batch, step_tokens, max_model_len=4096)
    s.fit(max_payload)
    added: set[str] = set()
    for i in range(data.draw(st.integers(1, 12))):
        gen = data.draw(requests(i))
        if s.check(gen) is None:
            s.add(gen, "inbox")
            added.add(gen.request_id)
    token = data.draw(ids)
    flight: list[Plan] = []
    for _ in range(5000):
        if not s.requests and not flight:
            break
        plan = s.schedule(ahead=bool(flight)) if len(flight) < 1 + pipelined else None
        if plan is not None:
            plan.step.version = "v" * m.MAX_VERSION_LEN
            plan.step.keep = True
            size = len(m.pack(plan.step))
            # rows, copies and finished ids within max_step_bytes; the step's own fields
            # (a version of 256 bytes) and its headers in the rest
            assert size <= max_payload - 1024, (size, len(plan.step.rows))
            for row, seq in zip(plan.step.rows, plan.seqs, strict=True):
                assert len(msgspec.msgpack.encode(row)) <= s._sent_cost(row, seq)
            for q in s.running:  # the bound that spares most rows computing their cost
                assert s._row_cost(q, s.max_step_tokens) <= q.req.max_row
            flight.append(plan)
            continue
        assert flight, "nothing planned, nothing in flight, requests live: a hang"
        done = flight.pop(0)
        s.apply(done, fake_reply(done, token), "v0")
    assert not s.requests and not flight, "requests never ended"
