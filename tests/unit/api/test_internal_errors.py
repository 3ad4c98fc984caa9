"""An unexpected exception in a generation request (a bug: in its handler, or in its
SSE writer's body) is logged at ERROR with its traceback, counted in /metrics
(``rollbus_task_failures_total{process="api"}``) and told to its client in OpenAI's
error shape: a 500 JSON answer, or an error event before ``[DONE]`` (never a stream
cut off without a word, nor a bare "Internal Server Error")."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.api.deps import Deps
from services.api.generate import Delta
from services.api.openai import OpenAIRoutes
from shared import messages as m
from shared.errors import ControlError
from shared.settings import Settings
from tests.unit.api.asgi import json_post


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    from services.tiny_model import create_model_dir

    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    return OpenAIRoutes(Deps(Settings(model=str(model), max_n=8, max_model_len=64)))


def errors(routes: OpenAIRoutes, code: int, route: str = "completions") -> float:
    value = routes.deps.metrics.registry.get_sample_value(
        "rollbus_generation_errors_total", {"route": route, "code": str(code)}
    )
    return value or 0.0


def failures(routes: OpenAIRoutes, task: str) -> float:
    value = routes.deps.metrics.registry.get_sample_value(
        "rollbus_task_failures_total", {"process": "api", "task": task}
    )
    return value or 0.0


class Broken:
    """A call whose deltas fail with a bug after one token."""

    closed = False

    async def deltas(self) -> AsyncIterator[Delta]:
        yield Delta(0, "a", [1], version="v0")
        raise RuntimeError("boom in a delta")

    async def close(self) -> None:
        self.closed = True


async def test_a_bug_in_a_stream_ends_it_with_an_error_event(
    routes: OpenAIRoutes, caplog: pytest.LogCaptureFixture
) -> None:
    job = routes.parse({"prompt": "x", "max_tokens": 4, "stream": True}, chat=False)
    call = Broken()
    before, errors_before = failures(routes, "sse_writer"), errors(routes, 500)
    with caplog.at_level(logging.ERROR):
        events = [e async for e in routes.sse(job, call)]  # type: ignore[arg-type]
    assert errors(routes, 500) == errors_before + 1  # in /metrics as an answered error
    assert call.closed  # its engine request is cancelled
    last = [json.loads(e[6:]) for e in events[:-1]][-1]
    assert last["error"]["code"] == 500 and "boom in a delta" in last["error"]["message"]
    assert set(last["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
    assert events[-1] == b"data: [DONE]\n\n"
    assert failures(routes, "sse_writer") == before + 1
    (rec,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rec.exc_info and "boom in a delta" in str(rec.exc_info[1])


async def test_a_bug_in_a_request_answers_500_in_openai_shape(
    routes: OpenAIRoutes, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def parse(body: Any, chat: bool) -> Any:
        raise RuntimeError("boom in parse")

    monkeypatch.setattr(routes, "parse", parse)
    before, errors_before = failures(routes, "generation"), errors(routes, 500)
    with caplog.at_level(logging.ERROR):
        resp = await routes.handle(json_post("/v1/completions", b'{"prompt": "x"}'), chat=False)
    assert resp.status_code == 500
    assert errors(routes, 500) == errors_before + 1
    err = json.loads(bytes(resp.body))["error"]
    assert err["type"] == "server_error" and "boom in parse" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert failures(routes, "generation") == before + 1
    assert any(r.exc_info for r in caplog.records if r.levelno == logging.ERROR)


class Failed:
    """A call whose step fails after one token (a rank killed: 503 from the engine)."""

    async def deltas(self) -> AsyncIterator[Delta]:
        yield Delta(0, "a", [1], version="v0")
        raise ControlError(503, "step 7 failed: ranks [1] gone")

    async def close(self) -> None:
        pass


async def test_errors_are_counted_by_route_and_code(routes: OpenAIRoutes) -> None:
    """A stream's error event and a non-streamed error answer both count in
    ``rollbus_generation_errors_total`` (they end no choice: the requests counter, by
    finish reason, never sees them)."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True}
    job = routes.parse(body, chat=True)
    before = errors(routes, 503, "chat")
    events = [e async for e in routes.sse(job, Failed())]  # type: ignore[arg-type]
    assert b"step 7 failed" in events[-2]
    assert errors(routes, 503, "chat") == before + 1
    before = errors(routes, 400)
    resp = await routes.handle(json_post("/v1/completions", b'{"prompt": 1.5}'), chat=False)
    assert resp.status_code == 400
    assert errors(routes, 400) == before + 1


class Endless:
    """A call that streams a token per delta until closed."""

    closed = False

    async def deltas(self) -> AsyncIterator[Delta]:
        while True:
            yield Delta(0, "a", [1], version="v0")

    async def close(self) -> None:
        self.closed = True


async def test_tokens_sent_to_a_client_that_left_are_counted(routes: OpenAIRoutes) -> None:
    """``rollbus_generation_tokens_total`` counts what was served: a stream whose client
    disconnects (its body generator closed) after 3 tokens counts them."""
    job = routes.parse({"prompt": "x", "max_tokens": 20, "stream": True}, chat=False)
    before = routes.deps.metrics.registry.get_sample_value("rollbus_generation_tokens_total")
    call = Endless()
    gen = routes.sse(job, call)  # type: ignore[arg-type]
    for _ in range(3):
        await gen.__anext__()
    await gen.aclose()  # what the server does when the client goes away
    assert call.closed
    after = routes.deps.metrics.registry.get_sample_value("rollbus_generation_tokens_total")
    assert after == (before or 0.0) + 3


def test_a_malformed_chunk_is_refused_when_decoded() -> None:
    from services.api.generate import decode_chunk

    good = m.GenChunk("r", 0, [1], [-0.5], "v0", top=[m.TopLogprobs.of([1, 2], [-0.5, -1.0])])
    assert decode_chunk(m.pack(good)).top == good.top
    bad = m.GenChunk("r", 0, [1], [-0.5], "v0", top=[m.TopLogprobs([1, 2], b"\0")])
    with pytest.raises(ValueError, match="top ids"):
        decode_chunk(m.pack(bad))
