"""The OpenAI routes carry ``logit_bias`` to the engine as two lists (ids, values); two keys
that name one token ("7", "07") are a 400 naming both (which value held was the JSON
parser's choice: the last); none = None."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from services.api.app import create_app
from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared import messages as m
from shared.settings import Settings


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(Path(tmp_path_factory.mktemp("lb")) / "tiny", seed=0)


@pytest.fixture(scope="module")
def routes(model: Path) -> OpenAIRoutes:
    return OpenAIRoutes(Deps(Settings(model=str(model))))


@pytest.mark.parametrize("chat", [False, True])
def test_logit_bias_reaches_the_gen_request(routes: OpenAIRoutes, chat: bool) -> None:
    body: dict = {"logit_bias": {"07": 100.0, "3": -100, "0": 1}, "n": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    job = routes.parse(body, chat=chat)
    assert job.gen.logit_bias == m.LogitBias([7, 3, 0], [100.0, -100.0, 1.0])


def test_a_key_of_thousands_of_leading_zeros_is_its_token(routes: OpenAIRoutes) -> None:
    # int() refuses strings of over 4300 digits: this was a 500
    job = routes.parse({"prompt": "hi", "logit_bias": {"0" * 5000 + "7": 1}}, chat=False)
    assert job.gen.logit_bias == m.LogitBias([7], [1.0])


LONG = "0" * 5000 + "7"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("first", "second", "shown"),
    [("7", "07", ("'7'", "'07'")), ("007", "7", ("'007'", "'7'")),
     ("7", LONG, ("'7'", repr(LONG[:256])))],
    ids=["7-07", "007-7", "7-long"],
)  # fmt: skip
def test_two_keys_naming_one_token_are_400_naming_both(
    model: Path, tmp_path: Path, chat: bool, first: str, second: str, shown: tuple[str, str]
) -> None:
    body: dict = {"model": "tiny", "logit_bias": {first: 5, "3": 1, second: -100}}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    app = create_app(Settings(model=str(model), data_dir=str(tmp_path)))
    route = "/v1/chat/completions" if chat else "/v1/completions"
    r = TestClient(app).post(route, json=body)  # refused before any bus is needed
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias"
    assert err["message"] == f"logit_bias: keys {shown[0]} and {shown[1]} name one token id (7)"


def test_no_or_empty_logit_bias_sends_none(routes: OpenAIRoutes) -> None:
    for extra in ({}, {"logit_bias": None}, {"logit_bias": {}}):
        assert routes.parse({"prompt": "hi", **extra}, chat=False).gen.logit_bias is None


def test_min_tokens_reaches_the_gen_request_and_over_max_tokens_is_400(
    routes: OpenAIRoutes,
) -> None:
    from services.api.body import BadRequest

    assert routes.parse({"prompt": "hi", "min_tokens": 3}, chat=False).gen.min_tokens == 3
    assert routes.parse({"prompt": "hi"}, chat=False).gen.min_tokens == 0
    with pytest.raises(BadRequest) as e:
        routes.parse({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, chat=False)
    assert e.value.param == "min_tokens"
