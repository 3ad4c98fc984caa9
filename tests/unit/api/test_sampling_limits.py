"""vLLM's ``min_p`` and ``allowed_token_ids`` are accepted (no longer refused) and reach
the engine request: min_p in [0, 1] (generation_config.json's when not given),
allowed_token_ids non-empty and within the model's vocabulary, else 400 naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.api.body import BadRequest
from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared.settings import Settings

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    return OpenAIRoutes(Deps(Settings(model=str(model), max_model_len=64)))


@pytest.mark.parametrize("chat", [False, True])
def test_they_reach_the_engine_request(routes: OpenAIRoutes, chat: bool) -> None:
    body = {**(CHAT if chat else {"prompt": "hi"}), "min_p": 0.25, "allowed_token_ids": [7, 3, 7]}
    gen = routes.parse(body, chat=chat).gen
    assert gen.min_p == 0.25 and gen.allowed_token_ids == [7, 3]  # repeats dropped
    plain = routes.parse(CHAT, chat=True).gen
    assert plain.min_p == 0.0 and plain.allowed_token_ids is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": ["1"]}, "allowed_token_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
    ],
)
def test_bad_values_are_400_naming_the_field(
    routes: OpenAIRoutes, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as e:
        routes.parse({"prompt": "hi", **extra}, chat=False)
    assert e.value.code == 400 and (e.value.param or "").startswith(param)  # [i]: the item


def test_min_p_default_from_generation_config(tmp_path: Path) -> None:
    d = create_model_dir(tmp_path / "m", seed=0)
    (d / "generation_config.json").write_text(json.dumps({"min_p": 0.05}))
    r = OpenAIRoutes(Deps(Settings(model=str(d), max_model_len=64)))
    assert r.parse(CHAT, chat=True).gen.min_p == 0.05
    assert r.parse({**CHAT, "min_p": 0}, chat=True).gen.min_p == 0.0


def test_bad_words_are_tokenized_as_vllm_does(routes: OpenAIRoutes, monkeypatch: Any) -> None:
    """Each word (stripped on the left) as it is, and with a leading space when that is
    another word of as many tokens (a BPE's " word" vs "word"); empty is a 400."""
    gen = routes.parse({"prompt": "hi", "bad_words": ["ab", " c"]}, chat=False).gen
    # the byte tokenizer: " ab" is one token longer, so only the plain encoding counts
    assert gen.bad_words == [[97, 98], [99]]
    assert routes.parse({"prompt": "hi"}, chat=False).gen.bad_words is None

    bpe = {"ab": [7, 8], " ab": [17, 8], "x": [5], " x": [5, 1]}
    monkeypatch.setattr(routes.tokenizer, "encode", lambda t, add_special_tokens=True: bpe[t])
    assert routes._bad_words(["ab", "x"]) == [[7, 8], [17, 8], [5]]
    monkeypatch.undo()
    for words in (["  "], [""], ["x" * 65]):
        with pytest.raises(BadRequest) as e:
            routes.parse({"prompt": "hi", "bad_words": words}, chat=False)
        assert e.value.param == "bad_words", words
