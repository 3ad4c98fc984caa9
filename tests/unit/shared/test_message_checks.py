"""Control arguments and generation messages name the bad field; the limits hold."""

from __future__ import annotations

import math

import msgspec
import pytest

from shared import messages as m
from shared.errors import ControlError


@pytest.mark.parametrize(
    ("data", "kind", "param"),
    [
        (b'{"mode": "sideways"}', m.PauseArgs, "mode"),
        (b'{"mode": "keep", "x": 1}', m.PauseArgs, "x"),
        (b'{"version": 3}', m.UpdateWeightsArgs, "version"),
        (b'{"version": ""}', m.UpdateWeightsArgs, "version"),
        (b'{"version": "' + b"v" * 257 + b'"}', m.UpdateWeightsArgs, "version"),
        (b'{"verify_checksum": "yes"}', m.UpdateWeightsArgs, "verify_checksum"),
        (b'{"tags": 5}', m.TagArgs, "tags"),
        (b"\xff", m.NoArgs, "body"),
        (b"[1]", m.NoArgs, "body"),
        (b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", m.NoArgs, "a"),
        (b'{"mode": "keep"}', m.NoArgs, "mode"),  # resume, is_paused, health: no fields
        (b'{"fersh": true}', m.StatusArgs, "fersh"),
        (b'{"tags": ["x"]}', m.SleepWorkerArgs, "tags[0]"),  # a rank checks its tags too
        (b'{"tags": ["weight", 1], "version": "v"}', m.WakeupWorkerArgs, "tags[1]"),
        (b'{"fresh": "yes"}', m.StatusArgs, "fresh"),
        # valid JSON msgspec does not read (it said "Input data was truncated", param body)
        (b'{"mode": "\\ud800"}', m.PauseArgs, "mode"),
        (b'{"tags": ["weight", "\\udc00"]}', m.TagArgs, "tags[1]"),
        (b'{"fresh": NaN}', m.StatusArgs, "fresh"),
        (b'{"verify_checksum": -Infinity}', m.UpdateWeightsArgs, "verify_checksum"),
    ],
)
def test_bad_control_arguments_name_the_field(data: bytes, kind: type, param: str) -> None:
    with pytest.raises(ControlError) as e:
        m.decode_args(data, kind)
    assert e.value.code == 400 and e.value.result == {"param": param}


def test_gen_request_limits() -> None:
    ok = m.GenRequest("r", [1], 1, seed=2**63 - 1, temperature=0.0)
    assert m.unpack(m.pack(ok), type=m.GenRequest) == ok
    for bad in (
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"seed": 2**63},
        {"stop_token_ids": [1] * (m.MAX_STOP_TOKEN_IDS + 17)},
        {"top_logprobs": m.MAX_TOP_LOGPROBS + 1},
        {"top_logprobs": -1},
    ):
        data = m.pack({"request_id": "r", "prompt_token_ids": [1], "max_tokens": 1, **bad})
        with pytest.raises(msgspec.ValidationError) as e:
            m.unpack(data, type=m.GenRequest)
        assert m.error_param(e.value) == next(iter(bad))
