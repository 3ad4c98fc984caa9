"""The OpenAI routes' request checks alone: structs, body limits, the route's own
limits (``n``, vocabulary, context length). No server: ``parse`` and ``parse_json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.api.body import BadRequest, check_tree, parse_json
from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.api.schema import MAX_JSON_DEPTH, MAX_STOP
from shared.settings import Settings


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    from services.tiny_model import create_model_dir

    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    return OpenAIRoutes(Deps(Settings(model=str(model), max_n=8, max_model_len=64)))


def refused(routes: OpenAIRoutes, body: Any, chat: bool = False) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        routes.parse(body, chat)
    assert e.value.code == 400
    return e.value


def as_python_writes(body: dict[str, Any]) -> Any:
    """What a client using Python's json sends: NaN / Infinity literals."""
    return parse_json(json.dumps(body).encode())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("presence_penalty", float("-inf")),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_field(
    routes: OpenAIRoutes, field: str, value: float
) -> None:
    with pytest.raises(BadRequest) as e:
        routes.parse(as_python_writes({"prompt": "hi", field: value}), False)
    assert e.value.param == field and "finite" in e.value.message


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),  # ROLLBUS_MAX_N=8 here
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 62}, "max_tokens"),  # 3 prompt tokens + 62 > max_model_len 64
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ["x"] * (MAX_STOP + 1)}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": "x" * 1025}, "stop"),
        ({"stop_token_ids": [1] * 257}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"stop_token_ids": [100000]}, "stop_token_ids"),  # outside the vocabulary
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 0 for i in range(1025)}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),  # keys are token ids
        ({"echo": True}, "echo"),  # not supported: refused, never silently ignored
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"echo": 1}, "echo"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"model": "other"}, "model"),
        ({"prompt": [1, 100000]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt[1]"),
        ({"prompt": ["a", 5]}, "prompt"),  # strings mixed with bare ids
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [[1], [1, 100000]]}, "prompt"),
        ({"prompt": ["a"] * 5, "n": 2}, "prompt"),  # 10 choices > ROLLBUS_MAX_N=8
        ({"prompt": ["a", "x" * 70]}, "prompt"),  # the second is longer than the context
        ({"prompt": "x" * 70}, "prompt"),  # longer than the context
        ({"prompt": None}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": 5}, "prompt"),
    ],
)
def test_completion_parameters_out_of_range(
    routes: OpenAIRoutes, extra: dict[str, Any], param: str
) -> None:
    assert refused(routes, {"prompt": "hi", **extra}).param == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 10000}, "max_completion_tokens"),
    ],
)
def test_chat_parameters_out_of_range(
    routes: OpenAIRoutes, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    assert refused(routes, body, chat=True).param == param


def test_valid_requests_pass_and_unknown_fields_are_tolerated(routes: OpenAIRoutes) -> None:
    job = routes.parse(
        {
            "prompt": "hi",
            "n": 8,
            "temperature": 0,
            "top_k": -1,
            "top_p": 1,
            "seed": -(2**63),
            "stop": "x",
            "logprobs": 0,
            "presence_penalty": 0.0,
            "echo": False,
            "best_of": 8,  # = n
            "suffix": None,
            "some_future_openai_field": {"a": [1]},
        },
        False,
    )
    assert job.gen.n == 8 and job.gen.top_k == 0 and job.stops == ["x"] and job.logprobs
    chat = routes.parse(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}], "x": 1}]},
        True,
    )
    assert chat.gen.max_tokens == 64 - len(chat.gen.prompt_token_ids)


def test_body_must_be_an_object(routes: OpenAIRoutes) -> None:
    assert refused(routes, [1, 2]).param == "body"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "\xff\xfe"}', "body"),  # not UTF-8
        (b'{"prompt": "hi",', "body"),  # not JSON
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "body"),
        (b"[" * 100_000 + b"]" * 100_000, "body"),  # deeper than Python's recursion
        (b'{"prompt": "\\ud800"}', "prompt"),  # lone surrogate
        (b'{"logit_bias": {"1": NaN}}', "logit_bias.1"),
        (b'{"messages": [{"role": "user", "content": Infinity}]}', "messages[0].content"),
    ],
)
def test_body_checks(raw: bytes, param: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_json(raw)
    assert e.value.param == param


def test_depth_limit_is_exact() -> None:
    ok: Any = 1
    for _ in range(MAX_JSON_DEPTH):
        ok = [ok]
    check_tree(ok)
    with pytest.raises(BadRequest):
        check_tree([ok])


def test_blank_body_is_the_default() -> None:
    assert parse_json(b"  ", empty={}) == {}


def test_a_missing_field_is_named(routes: OpenAIRoutes) -> None:
    assert refused(routes, {"max_tokens": 3}).param == "prompt"
    assert refused(routes, {"prompt": "x"}, chat=True).param == "messages"
