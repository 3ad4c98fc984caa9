"""What the engine accepts on ``rollbus.<i>.gen`` (reachable over raw NATS), the
waiting limit, per-request sampling failures, and fair rows for large ``n``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from services.engine.generation import Generation, Refused
from services.engine.scheduler import Plan, Scheduler
from shared import messages as m
from shared.settings import Settings


def generation(model_dir: Path, **kw: object) -> Generation:
    """An engine's generation side, no bus: what admission and step rows need."""
    s = Settings(model=str(model_dir), max_n=4, max_waiting=2, max_model_len=64, **kw)
    return Generation(SimpleNamespace(settings=s))  # type: ignore[arg-type]


def msg(**fields: object) -> bytes:
    body: dict[str, object] = {"request_id": "r1", "prompt_token_ids": [1, 2], "max_tokens": 4}
    body.update(fields)
    return msgspec.msgpack.encode(body)


@pytest.mark.parametrize(
    ("data", "param"),
    [
        (msg(temperature=float("nan")), "temperature"),
        (msg(temperature=float("inf")), "temperature"),
        (msg(top_p=0.0), "top_p"),
        (msg(top_k=-1), "top_k"),
        (msg(n=0), "n"),
        (msg(n=5), "n"),  # ROLLBUS_MAX_N=4
        (msg(max_tokens=-3), "max_tokens"),
        (msg(max_tokens=100), "max_tokens"),  # beyond the context length
        (msg(prompt_token_ids=[]), "prompt_token_ids"),
        (msg(prompt_token_ids=[1, 320]), "prompt_token_ids"),  # vocab_size is 320
        (msg(prompt_token_ids=[-1]), "prompt_token_ids[0]"),
        (msg(stop_token_ids=[10**6]), "stop_token_ids"),
        (msg(seed=2**64 - 1), "seed"),
        (msg(request_id=""), "request_id"),
        (msg(request_id="x" * 257), "request_id"),
        (msgspec.msgpack.encode({"prompt_token_ids": [1]}), "request_id"),  # missing
        (b"\xc1 not msgpack", ""),
        (msgspec.msgpack.encode([1, 2, 3]), ""),
    ],
)
def test_bad_gen_messages_are_refused_with_400(model_dir: Path, data: bytes, param: str) -> None:
    g = generation(model_dir)
    with pytest.raises(Refused) as e:
        g.admit_request(data)
    assert e.value.code == 400 and e.value.param == param
    assert not g.sched.requests


def test_duplicate_request_id_is_refused(model_dir: Path) -> None:
    g = generation(model_dir)
    g.sched.add(g.admit_request(msg()), "inbox")
    with pytest.raises(Refused) as e:
        g.admit_request(msg())
    assert e.value.param == "request_id"


def test_full_waiting_queue_answers_429(model_dir: Path) -> None:
    g = generation(model_dir)  # ROLLBUS_MAX_WAITING=2
    for rid in ("a", "b"):
        g.sched.add(g.admit_request(msg(request_id=rid)), "inbox")
    with pytest.raises(Refused) as e:
        g.admit_request(msg(request_id="c"))
    assert e.value.code == 429
    g.sched.schedule()  # both admitted to a step: no longer waiting
    assert g.sched.num_queued == 0
    g.sched.add(g.admit_request(msg(request_id="c")), "inbox")


def test_a_sampling_failure_ends_only_its_own_request() -> None:
    s = Scheduler(32, 4, 8, 64, max_model_len=64)
    a = s.add(m.GenRequest("a", [1, 2, 3], 5), "ia")
    b = s.add(m.GenRequest("b", [1, 2, 3], 5, n=2), "ib")
    plan = s.schedule()
    assert plan is not None
    ok = [a.seqs[0].seq_id]
    reply = m.StepReply(
        plan.step.step, ok, [7], [-0.1], failed=[(b.seqs[0].seq_id, 400, "bad temperature")]
    )
    outs = s.apply(plan, reply, "v0")
    errors = [o for o in outs if o.error]
    assert {o.seq.index for o in errors} == {0, 1}  # every choice of b ends
    assert all(o.error == (400, "bad temperature") and o.finish_reason == "error" for o in errors)
    assert "b" not in s.requests and "a" in s.requests
    assert [o.token for o in outs if o.seq.req is a] == [7]


def fake_reply(plan: Plan) -> m.StepReply:
    ids = [x.seq_id for row in plan.step.rows for x in row.sample]
    return m.StepReply(plan.step.step, ids, [7] * len(ids), [-0.5] * len(ids))


def test_large_n_does_not_starve_a_small_request() -> None:
    s = Scheduler(256, 4, 8, 512, max_model_len=256)
    big = s.add(m.GenRequest("big", [1, 2, 3], 100, n=8), "i1")
    plan = s.schedule()
    assert plan is not None
    s.apply(plan, fake_reply(plan), "v0")  # prefill + fork: 8 running sequences
    plan = s.schedule()
    assert plan is not None and len(plan.seqs) == 8
    s.apply(plan, fake_reply(plan), "v0")
    small = s.add(m.GenRequest("small", [1, 2, 3], 100), "i2")
    plan = s.schedule()
    assert plan is not None
    assert small.seqs[0] in plan.seqs  # admitted at once, though big could fill the batch
    assert sum(1 for x in plan.seqs if x.req is big) <= 4
    s.apply(plan, fake_reply(plan), "v0")
    stepped = {x.seq_id: 0 for x in big.seqs}
    for _ in range(4):  # both requests progress every step; big's choices take turns
        plan = s.schedule()
        assert plan is not None and small.seqs[0] in plan.seqs
        for x in plan.seqs:
            stepped[x.seq_id] = stepped.get(x.seq_id, 0) + 1
        s.apply(plan, fake_reply(plan), "v0")
    assert all(stepped[x.seq_id] > 0 for x in big.seqs)
