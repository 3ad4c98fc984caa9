"""``logit_bias`` on ``rollbus.<i>.gen`` (reachable over raw NATS): the engine refuses a
malformed one with a 400 naming ``logit_bias`` before it reaches a rank, and carries a
good one into every sample spec of the request's step rows."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.engine.generation import Refused
from services.engine.scheduler import Scheduler
from shared import messages as m
from tests.unit.engine.test_admission import generation


def msg(bias: object) -> bytes:
    body = {"request_id": "r1", "prompt_token_ids": [1, 2], "max_tokens": 4, "logit_bias": bias}
    return msgspec.msgpack.encode(body)


@pytest.mark.parametrize(
    "bias",
    [
        [[320], [1.0]],  # vocab_size is 320
        [[10**6], [1.0]],
        [[1, 2], [1.0]],  # lengths differ
        [[3, 3], [1.0, 2.0]],  # an id twice
        [[1], [100.5]],  # beyond OpenAI's range
        [[1], [float("nan")]],
        [[-1], [1.0]],
        [list(range(m.MAX_LOGIT_BIAS + 1)), [0.0] * (m.MAX_LOGIT_BIAS + 1)],
        "not a bias",
    ],
)
def test_bad_logit_bias_is_refused_with_400(model_dir: Path, bias: object) -> None:
    g = generation(model_dir)
    with pytest.raises(Refused) as e:
        g.admit_request(msg(bias))
    assert e.value.code == 400 and (e.value.param or "").startswith("logit_bias"), e.value
    assert not g.sched.requests


def test_a_good_bias_reaches_every_sample_spec(model_dir: Path) -> None:
    g = generation(model_dir)
    gen = g.admit_request(msg([[319, 0], [100.0, -100.0]]))
    assert gen.logit_bias == m.LogitBias([319, 0], [100.0, -100.0])
    s = Scheduler(32, 4, 8, 64, max_model_len=64)
    s.add(m.GenRequest("a", [1, 2, 3], 5, n=2, logit_bias=gen.logit_bias), "ia")
    s.add(m.GenRequest("b", [1, 2, 3], 5), "ib")
    plan = s.schedule()
    assert plan is not None
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(plan.step), type=m.StepRequest)
    specs = {x.seq_id: x for row in wire.rows for x in row.sample}
    req_a, req_b = s.requests["a"], s.requests["b"]
    assert all(specs[x.seq_id].logit_bias == gen.logit_bias for x in req_a.seqs)
    assert specs[req_b.seqs[0].seq_id].logit_bias is None


def test_min_tokens_over_max_tokens_is_refused(model_dir: Path) -> None:
    g = generation(model_dir)
    body = {"request_id": "r1", "prompt_token_ids": [1], "max_tokens": 4, "min_tokens": 5}
    with pytest.raises(Refused) as e:
        g.admit_request(msgspec.msgpack.encode(body))
    assert e.value.code == 400 and e.value.param == "min_tokens"
    assert g.admit_request(msgspec.msgpack.encode(body | {"min_tokens": 4})).min_tokens == 4
