"""The OpenAI routes carry ``logit_bias`` to the engine as two lists (ids, values); a key
written two ways ("7", "07") names one token, the last value wins; none = None."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared import messages as m
from shared.settings import Settings


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    d = create_model_dir(Path(tmp_path_factory.mktemp("lb")) / "tiny", seed=0)
    return OpenAIRoutes(Deps(Settings(model=str(d))))


@pytest.mark.parametrize("chat", [False, True])
def test_logit_bias_reaches_the_gen_request(routes: OpenAIRoutes, chat: bool) -> None:
    body: dict = {"logit_bias": {"7": 5, "3": -100, "07": 100.0}, "n": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    job = routes.parse(body, chat=chat)
    assert job.gen.logit_bias == m.LogitBias([7, 3], [100.0, -100.0])


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
