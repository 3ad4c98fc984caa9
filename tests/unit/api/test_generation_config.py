"""A request that does not set a sampling field gets generation_config.json's value (as
vLLM's default ``--generation-config auto``); a value the request sets wins (0 too);
``ROLLBUS_GENERATION_CONFIG=none`` applies nothing (OpenAI's defaults). max_new_tokens is
chat's default max_tokens; completions keep OpenAI's / vLLM's 16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared.settings import Settings

FILE = {"do_sample": False, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "repetition_penalty": 1.1, "max_new_tokens": 7}  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    (d / "generation_config.json").write_text(json.dumps(FILE))
    return d


def routes(model: Path, mode: str = "auto") -> OpenAIRoutes:
    return OpenAIRoutes(Deps(Settings(model=str(model), max_model_len=64, generation_config=mode)))


def sampling(job: Any) -> tuple[Any, ...]:
    g = job.gen
    return g.temperature, g.top_p, g.top_k, g.repetition_penalty, g.max_tokens


def test_a_request_without_them_gets_the_files(model: Path) -> None:
    r = routes(model)
    assert sampling(r.parse(CHAT, chat=True)) == (0.6, 0.95, 20, 1.1, 7)
    assert sampling(r.parse({"prompt": "hi"}, chat=False)) == (0.6, 0.95, 20, 1.1, 16)
    # null is "not set", as in vLLM
    assert r.parse({**CHAT, "temperature": None}, chat=True).gen.temperature == 0.6


def test_the_requests_own_values_win(model: Path) -> None:
    assert routes(model).parse(CHAT, chat=True).gen.temperature == 0.6
    body = {**CHAT, "temperature": 0, "top_p": 1, "top_k": -1, "repetition_penalty": 1,
            "max_tokens": 3}  # fmt: skip
    assert sampling(routes(model).parse(body, chat=True)) == (0.0, 1.0, 0, 1.0, 3)


def test_none_applies_nothing(model: Path) -> None:
    assert routes(model, "auto").parse(CHAT, chat=True).gen.temperature == 0.6
    r = routes(model, "none")
    chat = r.parse(CHAT, chat=True)
    assert sampling(chat)[:4] == (1.0, 1.0, 0, 1.0)
    assert chat.gen.max_tokens == 64 - len(chat.gen.prompt_token_ids)  # the context's rest


def test_max_new_tokens_within_the_context(model: Path) -> None:
    """The file's max_new_tokens never passes the context: a prompt leaving less room
    gets that room (vLLM's min of the two)."""
    r = routes(model)
    short = r.parse(CHAT, chat=True).gen
    assert short.max_tokens == 7
    base = len(short.prompt_token_ids) - 2  # the template's tokens
    text = "x" * (64 - 3 - base)  # a byte tokenizer: one token per character
    chat = r.parse({"messages": [{"role": "user", "content": text}]}, chat=True)
    assert len(chat.gen.prompt_token_ids) == 61 and chat.gen.max_tokens == 3
