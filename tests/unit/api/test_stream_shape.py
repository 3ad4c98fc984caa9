"""The SSE events of a stream as OpenAI, vLLM and FastDeploy shape them (no server: the
route's ``sse`` over a scripted call): a chat stream opens with one role-only chunk per
choice (``delta: {"role": "assistant", "content": ""}``) before any token, and never
names the role again; ``stream_options.continuous_usage_stats`` (with ``include_usage``)
puts the usage so far on every chunk; ``stream_options`` without ``stream: true`` is a
400."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.api.body import BadRequest
from services.api.deps import Deps
from services.api.generate import Delta
from services.api.openai import OpenAIRoutes
from shared.errors import ControlError
from shared.settings import Settings


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    from services.tiny_model import create_model_dir

    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    return OpenAIRoutes(Deps(Settings(model=str(model), max_n=8, max_model_len=64)))


class Scripted:
    """A call whose deltas are given: visible text from the first token on."""

    def __init__(self, deltas: list[Delta]) -> None:
        self._deltas = deltas

    async def deltas(self) -> AsyncIterator[Delta]:
        for d in self._deltas:
            yield d

    async def close(self) -> None:
        pass


async def events(routes: OpenAIRoutes, body: dict[str, Any], deltas: list[Delta]) -> list[Any]:
    job = routes.parse(body, chat="messages" in body)
    out = [e async for e in routes.sse(job, Scripted(deltas))]  # type: ignore[arg-type]
    assert out[-1] == b"data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in out[:-1]]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}


async def test_a_chat_stream_opens_with_a_role_only_chunk_per_choice(
    routes: OpenAIRoutes,
) -> None:
    deltas = [
        Delta(0, "A", [65], version="v0"),
        Delta(1, "B", [66], version="v0"),
        Delta(0, "C", [67], version="v0", finish_reason="length"),
        Delta(1, "D", [68], version="v0", finish_reason="length"),
    ]
    routes.deps.current_version = ""  # an API just started: no version seen yet
    evs = await events(routes, {**CHAT, "n": 2}, deltas)
    assert all(e["weight_version"] == "v0" for e in evs)
    first = [e["choices"][0] for e in evs[:2]]
    assert [c["index"] for c in first] == [0, 1]
    for c in first:
        assert c["delta"] == {"role": "assistant", "content": ""}
        assert c["finish_reason"] is None
    rest = [e["choices"][0] for e in evs[2:]]
    assert all("role" not in c["delta"] for c in rest)
    assert [c["delta"]["content"] for c in rest] == ["A", "B", "C", "D"]


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    routes: OpenAIRoutes,
) -> None:
    deltas = [
        Delta(0, "A", [65], version="v0"),
        Delta(0, "", [200], version="v0"),  # half a character: no text yet, one token more
        Delta(0, "B", [66], version="v0", finish_reason="length"),
    ]
    for body in (
        {**CHAT, "max_tokens": 3},
        {"prompt": "hi", "max_tokens": 3, "stream": True},
    ):
        opts = {"include_usage": True, "continuous_usage_stats": True}
        evs = await events(routes, {**body, "stream_options": opts}, deltas)
        usage = [e["usage"] for e in evs]
        prompt = usage[0]["prompt_tokens"]
        assert prompt > 0 and all(u["prompt_tokens"] == prompt for u in usage)
        assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usage)
        done = [u["completion_tokens"] for e, u in zip(evs, usage, strict=True) if e["choices"]]
        assert done[-3:] == [1, 2, 3]  # after a chat stream's role chunk (0)
        assert evs[-1]["choices"] == [] and usage[-1]["completion_tokens"] == 3
    # without it: only the final chunk has a usage
    evs = await events(routes, {**CHAT, "stream_options": {"include_usage": True}}, deltas)
    assert ["usage" in e for e in evs] == [False] * (len(evs) - 1) + [True]


async def test_continuous_usage_stats_needs_include_usage(routes: OpenAIRoutes) -> None:
    # as vLLM and FastDeploy: include_continuous_usage = include_usage and
    # continuous_usage_stats; alone it adds no usage to any chunk
    deltas = [Delta(0, "A", [65], version="v0", finish_reason="length")]
    for opts in (
        {"continuous_usage_stats": True},
        {"include_usage": False, "continuous_usage_stats": True},
    ):
        evs = await events(routes, {**CHAT, "stream_options": opts}, deltas)
        assert evs and not any("usage" in e for e in evs)


@pytest.mark.parametrize(
    "opts",
    [{"include_usage": True}, {"include_usage": None}, {"continuous_usage_stats": True}],
)
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_is_400(
    routes: OpenAIRoutes, opts: dict[str, Any], stream: bool | None
) -> None:
    for body in ({**CHAT, "stream": stream}, {"prompt": "hi", "stream": stream}):
        with pytest.raises(BadRequest) as e:
            routes.parse({**body, "stream_options": opts}, chat="messages" in body)
        assert e.value.code == 400 and e.value.param == "stream_options"
        assert "Stream options can only be defined when `stream=True`." in e.value.message
    # an empty or null stream_options is nothing to refuse
    for none in ({}, None):
        routes.parse({"prompt": "hi", "stream": stream, "stream_options": none}, chat=False)


async def test_a_stream_counts_its_choices_outcomes_in_metrics(routes: OpenAIRoutes) -> None:
    def count(route: str, reason: str) -> float:
        labels = {"route": route, "finish_reason": reason}
        value = routes.deps.metrics.registry.get_sample_value(
            "rollbus_generation_requests_total", labels
        )
        return value or 0.0

    deltas = [
        Delta(0, "A", [65], version="v0", finish_reason="stop"),
        Delta(1, "B", [66], version="v0", finish_reason="length"),
    ]
    before = [count("chat", "stop"), count("chat", "length"), count("completions", "length")]
    await events(routes, {**CHAT, "n": 2}, deltas)
    await events(routes, {"prompt": "hi", "n": 2, "stream": True}, deltas)
    after = [count("chat", "stop"), count("chat", "length"), count("completions", "length")]
    assert after == [before[0] + 1, before[1] + 1, before[2] + 1]


class Failing(Scripted):
    """A call the engine fails after one token (e.g. 503: a rank gone)."""

    async def deltas(self) -> AsyncIterator[Delta]:
        yield Delta(0, "A", [65], version="v0")
        raise ControlError(503, "step 7 failed: ranks [1] gone")


async def test_a_failed_stream_ends_with_an_openai_error_event(routes: OpenAIRoutes) -> None:
    job = routes.parse({"prompt": "hi", "max_tokens": 3, "stream": True}, chat=False)
    out = [e async for e in routes.sse(job, Failing([]))]  # type: ignore[arg-type]
    assert out[-1] == b"data: [DONE]\n\n"
    err = json.loads(out[-2][6:])["error"]
    assert err == {
        "message": "step 7 failed: ranks [1] gone",
        "type": "server_error",
        "param": None,
        "code": 503,
    }
