"""The scheduler alone: admission, chunked prefill, decode, fork, preemption, abort."""

from __future__ import annotations

import random

import pytest

from services.engine.scheduler import Plan, Scheduler
from shared import messages as m


def gen(
    rid: str, prompt: int = 5, max_tokens: int = 4, n: int = 1, stop: list[int] | None = None
) -> m.GenRequest:
    return m.GenRequest(rid, list(range(1, prompt + 1)), max_tokens, n=n, stop_token_ids=stop or [])


def fake_reply(plan: Plan, token: int = 7) -> m.StepReply:
    ids = [s.seq_id for row in plan.step.rows for s in row.sample]
    return m.StepReply(plan.step.step, ids, [token] * len(ids), [-0.5] * len(ids))


def sched(blocks: int = 16, bs: int = 4, batch: int = 8, step_tokens: int = 64) -> Scheduler:
    return Scheduler(blocks, bs, batch, step_tokens, max_model_len=64)


def test_prefill_then_decode_until_length() -> None:
    s = sched()
    s.add(gen("a", prompt=5, max_tokens=3), "inbox")
    plan = s.schedule()
    assert plan is not None
    (row,) = plan.step.rows
    assert row.token_ids == [1, 2, 3, 4, 5] and row.start_pos == 0 and len(row.block_table) == 2
    outs = s.apply(plan, fake_reply(plan), "v0")
    assert [o.token for o in outs] == [7] and outs[0].finish_reason is None
    plan = s.schedule()
    assert plan and plan.step.rows[0].token_ids == [7] and plan.step.rows[0].start_pos == 5
    s.apply(plan, fake_reply(plan), "v0")
    plan = s.schedule()
    assert plan is not None
    outs = s.apply(plan, fake_reply(plan), "v1")
    assert outs[0].finish_reason == "length"
    seq = outs[0].seq
    assert seq.output == [7, 7, 7]
    assert [(x.version, x.start, x.end) for x in seq.spans] == [("v0", 0, 2), ("v1", 2, 3)]
    assert s.alloc.num_free == 16 and not s.requests
    # the finished sequence is named once so rank 0 can drop its sampler: with the next
    # step that has rows, not in a step of its own (the end of a batch costs no round trip)
    assert s.schedule() is None
    s.add(gen("b", prompt=2, max_tokens=1), "inbox")
    plan = s.schedule()
    assert plan is not None and plan.step.finished == [seq.seq_id] and plan.step.rows
    s.apply(plan, fake_reply(plan), "v1")
    assert s.schedule() is None


def test_stop_token() -> None:
    s = sched()
    s.add(gen("a", stop=[7]), "inbox")
    plan = s.schedule()
    assert plan is not None
    assert s.apply(plan, fake_reply(plan, 7), "v0")[0].finish_reason == "stop"


def test_continuous_batching_new_request_joins() -> None:
    s = sched()
    s.add(gen("a", max_tokens=10), "i")
    p1 = s.schedule()
    assert p1 is not None
    s.apply(p1, fake_reply(p1), "v0")
    s.add(gen("b", prompt=3, max_tokens=10), "i")
    p2 = s.schedule()
    assert p2 is not None
    assert [len(r.token_ids) for r in p2.step.rows] == [1, 3]  # decode + prefill together


def test_chunked_prefill_samples_only_at_the_end() -> None:
    s = sched(step_tokens=4)
    s.add(gen("a", prompt=10), "i")
    sizes, samples = [], []
    for _ in range(3):
        plan = s.schedule()
        assert plan is not None
        sizes.append(len(plan.step.rows[0].token_ids))
        samples.append(len(plan.step.rows[0].sample))
        s.apply(plan, fake_reply(plan), "v0")
    assert sizes == [4, 4, 2] and samples == [0, 0, 1]


def test_n_choices_share_the_prefill_and_fork() -> None:
    s = sched(bs=4)
    req = s.add(gen("a", prompt=6, n=3, max_tokens=5), "i")
    plan = s.schedule()
    assert plan is not None
    (row,) = plan.step.rows  # one prefill for three choices
    assert [x.seq_id for x in row.sample] == [q.seq_id for q in req.seqs]
    assert [x.salt for x in row.sample] == [0, 1, 2]
    s.apply(plan, fake_reply(plan), "v0")
    leader, c1, c2 = req.seqs
    # full block shared, partial block copied
    assert c1.blocks[0] == leader.blocks[0] and c1.blocks[1] != leader.blocks[1]
    assert s.alloc.refs[leader.blocks[0]] == 3
    plan = s.schedule()
    assert plan is not None
    assert sorted(plan.step.copies) == sorted(
        [(leader.blocks[1], c1.blocks[1]), (leader.blocks[1], c2.blocks[1])]
    )
    assert [r.start_pos for r in plan.step.rows] == [6, 6, 6]
    assert all(len(r.sample) == 1 for r in plan.step.rows)


def test_fork_when_leader_finishes_immediately() -> None:
    s = sched()
    req = s.add(gen("a", prompt=6, n=2, max_tokens=1), "i")
    plan = s.schedule()
    assert plan is not None
    outs = s.apply(plan, fake_reply(plan), "v0")
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert s.alloc.num_free == 16 and not s.requests and all(q.output == [7] for q in req.seqs)


def test_preemption_recomputes_when_blocks_run_out() -> None:
    s = sched(blocks=4, bs=4)  # 16 token slots in all
    s.add(gen("a", prompt=4, max_tokens=8), "i")
    s.add(gen("b", prompt=4, max_tokens=8), "i")
    plan = s.schedule()
    assert plan is not None and len(plan.step.rows) == 2
    s.apply(plan, fake_reply(plan), "v0")
    for _ in range(6):
        plan = s.schedule()
        if plan is None:
            break
        s.apply(plan, fake_reply(plan), "v0")
    assert s.preemptions >= 1
    # nothing lost: both finish eventually with all their tokens
    done = {}
    for _ in range(100):
        plan = s.schedule()
        if plan is None:
            break
        for o in s.apply(plan, fake_reply(plan), "v0"):
            if o.finish_reason:
                done[o.seq.req.request_id] = o.seq.output_len
    assert done == {"a": 8, "b": 8} and s.alloc.num_free == 4


def test_request_too_big_for_cache_or_context() -> None:
    s = sched(blocks=2, bs=4)

    def why(prompt: int, max_tokens: int) -> tuple[str, str]:
        return s.check(gen("a", prompt=prompt, max_tokens=max_tokens)) or ("", "")

    assert why(6, 4) == ("needs 3 KV blocks, the cache has 2", "max_tokens")
    assert why(9, 1) == ("needs 3 KV blocks, the cache has 2", "prompt")  # the prompt alone
    assert "context length" in why(70, 10)[0] and why(70, 10)[1] == "prompt"
    assert why(60, 10)[1] == "max_tokens"
    assert "context length" in why(4, 61)[0] and why(4, 61)[1] == "max_tokens"
    assert s.check(gen("a", prompt=4, max_tokens=4)) is None


def test_abort_frees_everything_and_returns_partial() -> None:
    s = sched()
    s.add(gen("a", max_tokens=10), "i")
    s.add(gen("b", max_tokens=10, n=2), "i")
    plan = s.schedule()
    assert plan is not None
    s.apply(plan, fake_reply(plan), "v0")
    s.add(gen("c"), "i")  # still queued
    ended = s.abort(None, "abort")
    assert sorted({q.req.request_id for q in ended}) == ["a", "b", "c"]
    assert all(q.finish_reason == "abort" for q in ended)
    assert {q.req.request_id: q.output_len for q in ended if q.index == 0} == {
        "a": 1,
        "b": 1,
        "c": 0,
    }
    assert s.alloc.num_free == 16 and not s.running and not s.waiting and not s.requests


def test_recompute_all_replays_prompt_and_output() -> None:
    s = sched()
    s.add(gen("a", prompt=5, max_tokens=10), "i")
    for _ in range(3):
        plan = s.schedule()
        assert plan is not None
        s.apply(plan, fake_reply(plan), "v0")
    s.recompute_all()
    assert s.alloc.num_free == 16
    plan = s.schedule()
    assert plan is not None
    row = plan.step.rows[0]
    assert row.start_pos == 0 and row.token_ids == [1, 2, 3, 4, 5, 7, 7, 7]
    assert len(row.sample) == 1


def test_top_logprobs_travel_from_the_reply_to_each_output() -> None:
    s = sched()
    g = gen("a", n=2)
    g.top_logprobs = 3
    s.add(g, "inbox")
    s.add(gen("b"), "inbox")  # asks for none: its spec says 0, its output carries none
    plan = s.schedule()
    assert plan is not None
    specs = [spec for row in plan.step.rows for spec in row.sample]
    assert [spec.top_logprobs for spec in specs] == [3, 3, 0]
    ids = [spec.seq_id for spec in specs]
    top = [m.TopLogprobs.of([7, 1, 2], [-0.1, -2.5, -3.0]), m.TopLogprobs.of([7], [-0.1])]
    top.append(m.TopLogprobs([]))
    reply = m.StepReply(plan.step.step, ids, [7] * 3, [-0.1] * 3, top=top)
    reply = m.unpack(m.pack(reply), type=m.StepReply)  # as it crosses the bus
    outs = s.apply(plan, reply, "v0")
    assert [o.top.ids if o.top else None for o in outs] == [[7, 1, 2], [7], []]
    assert outs[0].top is not None and outs[0].top.logprobs == [
        pytest.approx(v, abs=1e-7) for v in (-0.1, -2.5, -3.0)
    ]
    # a reply without alternatives (nobody asked) leaves every output's top unset
    plan = s.schedule()
    assert plan is not None
    assert all(o.top is None for o in s.apply(plan, fake_reply(plan), "v0"))


def test_a_failed_sample_of_a_row_past_its_end_fails_no_sibling() -> None:
    """Pipelined: a choice that ended (stop) in step N still has a row in N+1, already
    sent; that row's sample failing must not end the request's other choices."""
    s = sched()
    req = s.add(gen("a", prompt=6, n=2, max_tokens=8), "i")
    plan = s.schedule()
    assert plan is not None
    s.apply(plan, fake_reply(plan), "v0")
    leader, other = req.seqs
    plan = s.schedule()
    assert plan is not None and len(plan.step.rows) == 2
    s.finish(leader, "stop")  # ended by step N's reply while this step was in flight
    reply = m.StepReply(
        plan.step.step,
        [other.seq_id],
        [7],
        [-0.5],
        failed=[(leader.seq_id, 500, "logits not finite")],
    )
    outs = s.apply(plan, reply, "v0")
    assert other.finish_reason is None and [o.token for o in outs] == [7]


@pytest.mark.parametrize("seed", range(40))
def test_a_reused_decode_spec_is_the_one_built_afresh(seed: int) -> None:
    # a decode row sends its sequence's spec of the row before while min_tokens' ban is
    # unchanged: through n > 1 forks, preemption, recompute and pipelined steps it must
    # equal the spec built for that row now (any field that changes mid-stream shows)
    rng = random.Random(seed)
    s = Scheduler(rng.choice([8, 40]), 4, rng.choice([2, 8]), rng.choice([4, 64]), max_model_len=64)
    inflight: list[Plan] = []
    checked = 0
    for it in range(80):
        if rng.random() < 0.3:
            g = m.GenRequest(
                f"r{it}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))],
                rng.randrange(1, 10), n=rng.choice([1, 2, 3]), stop_token_ids=[7, 9],
                min_tokens=rng.choice([0, 2, 4]), seed=rng.choice([None, 3]),
                presence_penalty=rng.choice([0.0, 0.5]),
            )  # fmt: skip
            if s.check(g) is None:
                s.add(g, "inbox")
        if rng.random() < 0.05:
            for p in inflight:
                s.apply(p, fake_reply(p, rng.choice([7, 8, 11])), "v0")
            inflight = []
            s.recompute_all()
        plan = s.schedule(ahead=bool(inflight))
        if plan is not None:
            for row, seq in zip(plan.step.rows, plan.seqs, strict=True):
                if len(row.sample) == 1 and not (seq.index == 0 and not seq.req.forked):
                    seq.pending -= 1  # as it was when the row was built
                    assert row.sample[0] == Scheduler._spec(seq)
                    seq.pending += 1
                    checked += 1
            inflight.append(plan)
        if inflight and (len(inflight) == 2 or rng.random() < 0.6):
            p = inflight.pop(0)
            s.apply(p, fake_reply(p, rng.choice([7, 8, 11])), "v0")
    assert checked  # decode rows were reached
