"""Steps of several decode iterations (``ROLLBUS_DECODE_STEPS``): the scheduler's choice
of how many (``Scheduler.decode_iters``), and the engine loop applying their tokens the
way one-token steps would (the stand-in ranks of ``test_pipeline`` run the iterations)."""

from __future__ import annotations

from typing import Any

import pytest

from services.engine.scheduler import Plan, Scheduler
from shared import messages as m
from tests.unit.engine.test_pipeline import outputs, run
from tests.unit.engine.test_scheduler import gen, sched


def decoding(s: Scheduler, *gens: m.GenRequest) -> Plan:
    """``gens`` prefilled (their first token 7 applied): the next plan is all decode."""
    for g in gens:
        s.add(g, "i")
    plan = s.schedule()
    assert plan is not None and plan.step.iters == 1  # a prefill is one iteration
    ids = [sp.seq_id for row in plan.step.rows for sp in row.sample]
    s.apply(plan, m.StepReply(plan.step.step, ids, [7] * len(ids), [-0.5] * len(ids)), "v0")
    return plan


def k_of(s: Scheduler, steps: int = 4, ahead: bool = False) -> int:
    plan = s.schedule(steps=steps, ahead=ahead)
    assert plan is not None
    return plan.step.iters


def test_decode_rows_get_the_setting_and_their_positions_are_counted() -> None:
    s = sched()
    decoding(s, gen("a", prompt=5, max_tokens=20))
    plan = s.schedule(steps=4)
    assert plan is not None and plan.step.iters == 4
    (row,) = plan.step.rows
    seq = plan.seqs[0]
    # one new token at 5; the ranks compute positions 5..8 and sample 4 tokens
    assert row.token_ids == [7] and row.start_pos == 5
    assert seq.num_computed == 9 and seq.pending == 4 and seq.length == 10
    # blocks for every position the iterations write, in the row's table
    assert len(seq.blocks) * 4 >= 9 and row.block_table == seq.blocks
    ahead = s.schedule(steps=4, ahead=True)  # continues after the 4 tokens
    assert ahead is not None and ahead.step.rows[0].prev and ahead.step.rows[0].start_pos == 9


def test_one_iteration_is_todays_step() -> None:
    s = sched()
    decoding(s, gen("a", prompt=5, max_tokens=20))
    plan = s.schedule()
    assert plan is not None and plan.step.iters == 1
    assert plan.seqs[0].num_computed == 6 and plan.seqs[0].pending == 1
    # a message without ``iters`` (today's, a raw client's) is a step of one iteration
    today = m.pack(plan.step)
    assert today[-1:] == b"\x01"  # iters, the last array item
    old = bytes([today[0] - 1]) + today[1:-1]  # the array one item shorter, without it
    assert m.unpack(old, type=m.StepRequest) == plan.step


def test_a_step_of_block_copies_alone_is_one_iteration() -> None:
    s = sched()
    s.add(gen("n", prompt=5, max_tokens=1, n=2), "i")  # prompt 5: its last block is copied
    p = s.schedule(steps=4)
    assert p is not None
    ids = [sp.seq_id for row in p.step.rows for sp in row.sample]
    s.apply(p, m.StepReply(p.step.step, ids, [7] * len(ids), [-0.5] * len(ids)), "v0")
    copies = s.schedule(steps=4)  # both ended (max_tokens 1): the fork's copy goes alone
    assert copies is not None and not copies.step.rows and copies.step.iters == 1


@pytest.mark.parametrize(
    ("kw", "k"),
    [
        ({"max_tokens": 3}, 2),  # one of 3 out: 2 left
        ({"max_tokens": 20}, 4),
        ({"max_tokens": 20, "bad_words": [[9]]}, 1),  # its ban (and tail) per token
        ({"max_tokens": 20, "bad_words": [[9, 10]]}, 1),
        ({"max_tokens": 20, "min_tokens": 3, "stop_token_ids": [5]}, 2),  # banned 2 more
        ({"max_tokens": 20, "min_tokens": 1, "stop_token_ids": [5]}, 4),  # ban over
        ({"max_tokens": 20, "presence_penalty": 0.5, "logit_bias": m.LogitBias([3], [1.0])}, 4),
    ],
)
def test_the_iterations_a_request_allows(kw: dict[str, Any], k: int) -> None:
    s = sched()
    decoding(s, m.GenRequest("a", [1, 2, 3, 4, 5], **kw))
    assert k_of(s) == k


def test_the_row_with_fewest_tokens_left_bounds_the_step() -> None:
    s = sched()
    decoding(s, gen("a", max_tokens=20), gen("b", max_tokens=2))
    assert k_of(s) == 1  # b has one token left


def test_the_context_length_bounds_it() -> None:
    s = Scheduler(16, 4, 8, 64, max_model_len=8)
    decoding(s, m.GenRequest("a", [1, 2, 3, 4, 5], 3))
    assert k_of(s) == 2  # 6 tokens, 8 the most: 2 more


def test_a_prefill_or_a_request_waiting_to_fork_makes_it_one() -> None:
    s = sched()
    decoding(s, gen("a", max_tokens=20))
    s.add(gen("b", prompt=3, max_tokens=20), "i")  # its prefill joins the step
    assert k_of(s) == 1
    s2 = sched()
    s2.add(gen("n", max_tokens=20, n=2), "i")
    assert k_of(s2) == 1  # the prompt samples for both choices


def test_a_prefill_chunk_makes_it_one() -> None:
    s = sched(step_tokens=4)
    s.add(gen("a", prompt=9, max_tokens=20), "i")
    p = s.schedule(steps=4)
    assert p is not None and p.step.iters == 1 and not p.step.rows[0].sample


def test_iterations_are_cut_to_the_free_blocks_never_preempting() -> None:
    s = sched(blocks=2, bs=4)
    decoding(s, gen("a", prompt=3, max_tokens=20))  # 4 tokens, 3 computed: one block
    assert s.alloc.num_free == 1
    # K iterations write positions 3..3+K-1: the one free block holds up to position 7
    assert k_of(s, steps=8) == 5 and s.preemptions == 0 and s.alloc.num_free == 0


def test_iterations_are_cut_to_the_step_message_room_for_grown_block_tables() -> None:
    def k_in(space: int) -> int:
        s = sched(blocks=64, bs=1)
        decoding(s, gen("a", prompt=3, max_tokens=20))
        plan = s.schedule()  # one iteration: its table holds 4 blocks
        assert plan is not None and len(plan.step.rows[0].block_table) == 4
        return s.decode_iters(plan.step.rows, plan.seqs, 4, space=space)

    # 1-token blocks: 4 iterations add 4 blocks (at most 5 bytes each) and the table's
    # header may grow (at most 4 bytes): 24 bytes; 3 iterations 3 blocks, 19 bytes
    assert k_in(24) == 4
    assert k_in(23) == 3
    assert k_in(18) == 2
    assert k_in(0) == 1


@pytest.mark.parametrize("top", [0, 20])
def test_iterations_are_cut_to_what_rank_0s_reply_has_room_for(top: int) -> None:
    """Rank 0 answers every iteration's samples (and alternatives) in one reply: K times
    a one-token step's bytes, past max_payload it is not published and the step fails."""
    payload = 32 * 1024
    s = Scheduler(4096, 4, 64, 2048, max_model_len=256)
    s.fit(payload)
    g = m.GenRequest("a", [1, 2, 3], 40, n=32, logprobs=True, top_logprobs=top, seed=1)
    s.add(g, "i")
    first = s.schedule(steps=32)
    assert first is not None
    ids = [sp.seq_id for row in first.step.rows for sp in row.sample]
    s.apply(first, m.StepReply(1, ids, [7] * len(ids), [-0.5] * len(ids)), "v0")
    plan = s.schedule(steps=32)
    assert plan is not None and len(plan.step.rows) == 32
    k = plan.step.iters
    assert k > 1
    # the largest reply those iterations may give: every token id and seq id at its
    # widest, every alternative's id too
    samples = 32 * k
    alts = [m.TopLogprobs([2**31 - 1] * top, bytes(4 * top)) for _ in range(samples)]
    reply = m.StepReply(
        plan.step.step, [2**31 - 1] * samples, [2**31 - 1] * samples, [-0.123456789] * samples,
        seconds=0.25, top=alts,
    )  # fmt: skip
    assert len(m.pack(reply)) <= payload, (k, len(m.pack(reply)))


def test_a_control_call_waiting_for_the_lock_gets_one_iteration() -> None:
    async def check() -> None:
        from tests.unit.engine.test_step_lock import engine

        eng = engine()
        eng.settings.decode_steps = 4
        g = eng.scheduler
        decoding(g.sched, gen("a", max_tokens=20))
        g._lock_wanted = 1
        p = g._plan()
        assert p is not None and p.step.iters == 1
        g._lock_wanted = 0
        p = g._plan(ahead=True)
        assert p is not None and p.step.iters == 4

    import asyncio

    asyncio.run(check())


@pytest.mark.parametrize("pipeline", [False, True])
async def test_k_step_runs_give_what_one_token_steps_give(pipeline: bool) -> None:
    _, one = await run(False)
    _, many = await run(pipeline, decode_steps=4)
    assert any(s.iters == 4 for s in many.steps)
    assert len(many.steps) < len(one.steps)
    assert outputs(many) == outputs(one)
    # a choice's tokens of one step go in one chunk
    assert any(len(c.token_ids) > 1 for cs in many.chunks.values() for c in cs)
    # c ends on its stop token 40 mid-window: nothing after it was sent
    out = outputs(many)
    assert out[("c", 0)][1] == "stop" and out[("c", 0)][0][-1] == 40


async def test_a_step_of_k_iterations_gets_time_for_its_iterations_not_k_bounds() -> None:
    """``STALL_S`` (5 s here) and the reply wait bound one step; a step of 4 iterations
    gets ``ITER_MARGIN`` times a recent iteration's time for each of the 3 more (at most
    the bound each): never a stall while its iterations are as quick as steps, and a
    stopped rank is named about as soon as with one-token steps."""
    import time

    from services.engine.generation import ITER_MARGIN
    from tests.unit.engine.test_step_lock import engine

    gen = engine().scheduler
    gen.active, gen.in_step = True, 3
    gen._iters = [4]
    gen.iter_avg = 0.1  # 100 ms per iteration lately: 3 x 1 s more
    assert gen._bound(5.0, 4) == 5.0 + 3 * ITER_MARGIN * 0.1
    gen.last_progress = time.monotonic() - 7.0
    assert gen.stall() is None
    gen.last_progress = time.monotonic() - 8.5
    assert "no progress for" in (gen.stall() or "")
    gen.iter_avg = 10.0  # slow iterations: at most the bound each (4 x 5 s in all)
    assert gen._bound(5.0, 4) == 20.0
    gen.iter_avg = 0.0  # no iteration seen yet: the bound each
    assert gen._bound(5.0, 4) == 20.0
    gen._iters = [1]  # a step of one iteration: the bound, as before
    gen.last_progress = time.monotonic() - 6.0
    assert gen.stall()


async def test_a_cancel_during_k_step_runs_takes_effect_after_the_steps_in_flight() -> None:
    """A cancel that comes while steps of 4 iterations run ends the request after the
    steps in flight (README: up to ``DECODE_STEPS`` tokens later, twice that pipelined):
    their tokens for it are dropped, never sent; the other requests go on unchanged."""
    from tests.unit.engine.test_pipeline import Ranks

    def during(eng: Any, ranks: Ranks) -> None:
        def on_chunk(rid: str, c: m.GenChunk) -> None:
            if rid == "a" and len(ranks.chunks["a"]) == 2:
                eng.scheduler._cancels.append("a")

        ranks.on_chunk = on_chunk

    _, many = await run(True, during, decode_steps=4)
    a = many.chunks["a"]
    assert [c.finish_reason for c in a] == [None, None, "abort"]
    assert 1 < sum(len(c.token_ids) for c in a) <= 1 + 4  # the prefill's, then one step's
    _, one = await run(False)
    assert {k: v for k, v in outputs(many).items() if k[0] != "a"} == {
        k: v for k, v in outputs(one).items() if k[0] != "a"
    }
