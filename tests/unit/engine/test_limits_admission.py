"""``min_p`` / ``allowed_token_ids`` on ``rollbus.<i>.gen`` (reachable over raw NATS): the
engine refuses bad ones with a 400 naming the field before a rank sees them, and carries
good ones into every sample spec of the request (none for a request without them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.engine.generation import Refused
from services.engine.scheduler import Scheduler
from shared import messages as m
from tests.unit.engine.test_admission import generation


def msg(**kw: Any) -> bytes:
    return msgspec.msgpack.encode(
        {"request_id": "r1", "prompt_token_ids": [1], "max_tokens": 4, **kw}
    )


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"allowed_token_ids": [320]}, "allowed_token_ids"),  # vocab_size is 320
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": list(range(m.MAX_ALLOWED_TOKEN_IDS + 1))}, "allowed_token_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
    ],
)
def test_bad_ones_are_refused_with_400(model_dir: Path, kw: dict[str, Any], param: str) -> None:
    g = generation(model_dir)
    with pytest.raises(Refused) as e:
        g.admit_request(msg(**kw))
    assert e.value.code == 400 and (e.value.param or "").startswith(param), e.value
    assert not g.sched.requests


def test_good_ones_reach_every_sample_spec(model_dir: Path) -> None:
    gen = generation(model_dir).admit_request(msg(allowed_token_ids=[319, 2], min_p=0.2))
    assert gen.allowed_token_ids == [319, 2] and gen.min_p == 0.2
    s = Scheduler(32, 4, 8, 64, max_model_len=64)
    s.add(m.GenRequest("a", [1, 2, 3], 5, n=2, min_p=0.2, allowed_token_ids=[319, 2]), "ia")
    s.add(m.GenRequest("b", [1, 2, 3], 5), "ib")
    plan = s.schedule()
    assert plan is not None
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(plan.step), type=m.StepRequest)
    specs = {x.seq_id: x for row in wire.rows for x in row.sample}
    assert all(specs[x.seq_id].limits == m.Limits(0.2, [319, 2]) for x in s.requests["a"].seqs)
    assert all(specs[x.seq_id].limits is None for x in s.requests["b"].seqs)


def test_bad_words_out_of_the_vocabulary_are_refused(model_dir: Path) -> None:
    g = generation(model_dir)
    with pytest.raises(Refused) as e:
        g.admit_request(msg(bad_words=[[1, 320]]))
    assert e.value.code == 400 and e.value.param == "bad_words"


def test_bad_words_reach_the_specs_single_in_the_ban_longer_with_the_tail() -> None:
    """Single-token words join every spec's ban (with min_tokens' stop ids); longer ones
    go with the output's last (longest - 1) tokens the engine has."""
    s = Scheduler(32, 4, 8, 64, max_model_len=64)
    gen = m.GenRequest("a", [1, 2, 3], 6, bad_words=[[9], [4, 5, 6], [7, 8]],
                       stop_token_ids=[2], min_tokens=6)  # fmt: skip
    s.add(gen, "ia")
    seq = s.requests["a"].seqs[0]

    def spec() -> m.SamplingSpec:
        plan = s.schedule()
        assert plan is not None
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(plan.step), type=m.StepRequest)
        return wire.rows[0].sample[0]

    first = spec()  # from the prompt: no output yet
    assert first.ban == [2, 9]
    assert first.limits == m.Limits(0.0, None, [[4, 5, 6], [7, 8]], [])
    seq.num_computed, seq.tokens = 3, [1, 2, 3, 10, 4, 5]  # two output tokens known
    s.running = [seq] if seq not in s.running else s.running
    later = spec()
    assert later.limits is not None and later.limits.tail == [4, 5]  # reach 2
