"""``min_tokens`` (vLLM's semantics): before the minimum, the request's stop ids (eos
included) are banned — the engine lists them in the sample spec's ``ban``, the rank's
sampler masks their logits; from the minimum on, nothing is banned."""

from __future__ import annotations

import numpy as np

from services.engine.scheduler import Scheduler
from services.worker.sampling import SamplingParams, make_generator, sample
from shared import messages as m


def test_banned_ids_are_never_sampled_greedy_or_drawn() -> None:
    x = np.random.default_rng(0).normal(0, 3, (1, 40)).astype(np.float32)
    top = int(np.argmax(x[0]))
    x[0, top] += 30.0
    assert sample(x, [SamplingParams(temperature=0, ban_ids=[top])], [make_generator(1, 0)])[
        0
    ] != [top]
    g = make_generator(1, 0)
    p = SamplingParams(temperature=1.0, seed=1, ban_ids=[top, 3])
    drawn = {sample(x, [p], [g])[0][0] for _ in range(200)}
    assert not drawn & {top, 3} and len(drawn) > 3


def test_the_scheduler_bans_stop_ids_until_min_tokens() -> None:
    s = Scheduler(64, 4, 8, 64, max_model_len=64)
    req = s.add(m.GenRequest("a", [1, 2, 3], 6, n=2, stop_token_ids=[5, 9], min_tokens=2), "i")
    other = s.add(m.GenRequest("b", [1, 2, 3], 6, stop_token_ids=[5]), "i")
    bans: list[list[object]] = []
    for _ in range(4):
        plan = s.schedule()
        assert plan is not None
        specs = {x.seq_id: x for row in plan.step.rows for x in row.sample}
        assert specs[other.seqs[0].seq_id].ban is None
        bans.append([specs[q.seq_id].ban for q in req.seqs if q.seq_id in specs])
        ids = list(specs)
        s.apply(plan, m.StepReply(plan.step.step, ids, [7] * len(ids), [-0.5] * len(ids)), "v0")
    assert bans[0] == [[5, 9], [5, 9]]  # output index 0: every choice
    assert bans[1] == [[5, 9], [5, 9]]  # index 1
    assert bans[2] == [None, None] and bans[3] == [None, None]


def test_min_tokens_ban_reaches_the_wire_and_old_specs_decode() -> None:
    spec = m.SamplingSpec(1, ban=[5, 9])
    back = m.unpack(m.pack(spec), type=m.SamplingSpec)
    assert back.ban == [5, 9]
    old = m.pack([1, 1.0, 1.0, 0, None, 0, False, 0, None])  # before ban
    assert m.unpack(old, type=m.SamplingSpec).ban is None
