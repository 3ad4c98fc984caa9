"""A key given twice in a JSON object is found, with its path; control arguments given
null are their defaults (the engine's rule for every transport)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from shared import jsonkeys
from shared import messages as m
from shared.errors import ControlError


@pytest.mark.parametrize(
    "data, path",
    [
        (b'{"mode": "abort", "mode": "keep"}', "mode"),
        (b'{"a": 1, "b": {"c": 1, "c": 2}}', "b.c"),
        (b'{"messages": [{"role": "user"}, {"role": "user", "role": "system"}]}',
         "messages[1].role"),
        (b'[{"x": 1}, [{"y": 1, "y": 1}]]', "[1][0].y"),
        (b'{"a": 1, "b": 2}', None),
        (b'{"a": {"a": 1}}', None),  # the same key at two levels is two keys
        (b'{"a": 1, "a"', None),  # not JSON: the decoder's to name
    ],
)  # fmt: skip
def test_a_key_given_twice_is_named_by_its_path(data: bytes, path: str | None) -> None:
    assert jsonkeys.duplicate_in(data) == path


def test_control_arguments_refuse_a_key_given_twice() -> None:
    with pytest.raises(ControlError) as e:
        m.decode_args(b'{"mode": "abort", "mode": "keep"}', m.PauseArgs)
    assert e.value.code == 400 and e.value.result == {"param": "mode"}


@pytest.mark.parametrize(
    "data, kind, want",
    [
        (b'{"mode": null}', m.PauseArgs, m.PauseArgs()),
        (b'{"mode": ""}', m.PauseArgs, m.PauseArgs()),
        (b'{"fresh": null}', m.StatusArgs, m.StatusArgs()),
        (b'{"tags": null}', m.TagArgs, m.TagArgs()),
        (b'{"version": null, "verify_checksum": true}', m.UpdateWeightsArgs,
         m.UpdateWeightsArgs(verify_checksum=True)),
    ],
)  # fmt: skip
def test_a_known_control_field_given_null_is_its_default(
    data: bytes, kind: type, want: object
) -> None:
    assert m.decode_args(data, kind) == want


@pytest.mark.parametrize(
    "data, kind, param",
    [
        (b'{"mod": null}', m.PauseArgs, "mod"),  # unknown: 400 whatever its value
        (b'{"x": null}', m.NoArgs, "x"),
        (b'{"version": ""}', m.UpdateWeightsArgs, "version"),  # "" is no version
        (b'{"fresh": ""}', m.StatusArgs, "fresh"),
    ],
)
def test_an_unknown_field_or_a_blank_one_stays_400(data: bytes, kind: type, param: str) -> None:
    with pytest.raises(ControlError) as e:
        m.decode_args(data, kind)
    assert e.value.code == 400 and e.value.result == {"param": param}


def test_a_long_token_id_list_costs_about_its_parse() -> None:
    """The engine checks a raw NATS client's JSON gen request on its event loop: a body of
    100k token ids and no duplicate took four times its parse (every list walked for a
    path that was not there); now about the parse itself."""
    raw = json.dumps({"request_id": "a", "prompt_token_ids": list(range(100_000))}).encode()

    def best(f: Callable[[bytes], Any]) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f(raw)
            times.append(time.perf_counter() - t)
        return min(times)

    assert jsonkeys.duplicate_in(raw) is None
    assert best(jsonkeys.duplicate_in) < 2.5 * best(json.loads)
