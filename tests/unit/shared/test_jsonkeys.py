"""A key given twice in a JSON object is found, with its path; control arguments given
null are their defaults (the engine's rule for every transport)."""

from __future__ import annotations

import json
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


def test_a_body_without_a_repeated_key_is_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine checks a raw NATS client's JSON gen request on its event loop: a body of
    100k token ids and no duplicate took four times its parse when every list was walked
    for a path that was not there; the walk now runs only when the parse saw a repeat
    (speed itself is the benchmarks' to measure, not a unit test's)."""
    raw = json.dumps({"request_id": "a", "prompt_token_ids": list(range(100_000))}).encode()

    def walked(doc: Any) -> str | None:
        raise AssertionError("walked a body whose parse saw no repeated key")

    monkeypatch.setattr(jsonkeys, "duplicate", walked)
    assert jsonkeys.duplicate_in(raw) is None
    with pytest.raises(AssertionError, match="walked"):  # a repeat is still looked for
        jsonkeys.duplicate_in(b'{"a": 1, "a": 2}')
