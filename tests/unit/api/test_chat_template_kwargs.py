"""``chat_template_kwargs`` in /v1/chat/completions bodies (vLLM's field): validated, and
passed to the template; the template is rendered on a worker thread, never on the
event loop. Real tokenizer dirs with the Qwen3 template, no server (``parse`` and the
route handler, which answers a refused chat before any bus call)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from starlette.requests import Request

from services.api.body import BadRequest
from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared.settings import Settings
from tests.fixtures.chat import CHATS, make_tokenizer_dir
from tests.unit.api.asgi import json_post


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    d = create_model_dir(tmp_path_factory.mktemp("q3") / "qwen3", config={"vocab_size": 512})
    make_tokenizer_dir(d, "qwen3")
    return OpenAIRoutes(Deps(Settings(model=str(d))))


def test_enable_thinking_reaches_the_template(routes: OpenAIRoutes) -> None:
    tok = routes.tokenizer
    plain = routes.parse({"messages": CHATS["user"]}, chat=True).gen.prompt_token_ids
    off = routes.parse(
        {"messages": CHATS["user"], "chat_template_kwargs": {"enable_thinking": False}}, chat=True
    ).gen.prompt_token_ids
    text = tok.apply_chat_template(CHATS["user"], True, {"enable_thinking": False})
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off == tok.encode(text, add_special_tokens=False)
    assert off[: len(plain)] == plain and len(off) > len(plain)


@pytest.mark.parametrize(
    "value",
    [
        "enable_thinking",
        ["enable_thinking"],
        {"messages": []},
        {"add_generation_prompt": False},
        {f"k{i}": i for i in range(65)},
    ],
)
def test_bad_chat_template_kwargs_are_400(routes: OpenAIRoutes, value: Any) -> None:
    with pytest.raises(BadRequest) as e:
        routes.parse({"messages": CHATS["user"], "chat_template_kwargs": value}, chat=True)
    assert e.value.code == 400 and e.value.param == "chat_template_kwargs"


def request(body: dict[str, Any]) -> Request:
    return json_post("/v1/chat/completions", json.dumps(body).encode())


async def test_template_renders_off_the_event_loop(
    routes: OpenAIRoutes, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[threading.Thread] = []

    def refuse(*args: Any, **kwargs: Any) -> str:
        threads.append(threading.current_thread())
        raise ValueError("refused on purpose")

    monkeypatch.setattr(routes.tokenizer, "apply_chat_template", refuse)
    resp = await routes.handle(request({"messages": CHATS["user"]}), chat=True)
    assert resp.status_code == 400 and b"refused on purpose" in resp.body
    assert threads and threads[0] is not threading.current_thread()
