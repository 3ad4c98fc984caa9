"""The OpenAI surface as a client meets it before a request reaches the engine (session
12's black-box audit): the body's Content-Type, the 401's ``WWW-Authenticate``, fields
that must be honoured or refused (never silently ignored), ``/v1/models/``. Through the
app, without a bus: every answer here comes before the engine is asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from services.api.app import create_app
from services.api.body import BadRequest, parse_json
from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared import messages as m
from shared.settings import Settings

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# refused by the route's own checks (n >= 1), so an answer naming `n` proves the body got
# past the Content-Type check and was read as JSON
BAD_N = json.dumps({"prompt": "hi", "n": 0}).encode()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)


@pytest.fixture(scope="module")
def client(model: Path) -> TestClient:
    # not entered as a context manager: no lifespan, so no bus is connected
    return TestClient(create_app(Settings(model=str(model), max_model_len=64)))


@pytest.fixture(scope="module")
def routes(model: Path) -> OpenAIRoutes:
    return OpenAIRoutes(Deps(Settings(model=str(model), max_n=8, max_model_len=64)))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "json"]
)
def test_a_body_that_is_not_declared_json_is_refused(
    client: TestClient, path: str, ctype: str
) -> None:
    """A JSON body sent as `text/plain` (what `curl -d` or a browser form sends) is 400
    naming the header, as vLLM refuses it — never generated from."""
    r = client.post(path, content=BAD_N, headers={"content-type": ctype})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "content-type" and "application/json" in err["message"]


@pytest.mark.parametrize(
    "ctype",
    [None, "application/json", "application/json; charset=utf-8", "Application/JSON",
     "application/vnd.api+json"],
)  # fmt: skip
def test_a_json_body_is_read(client: TestClient, ctype: str | None) -> None:
    headers = {} if ctype is None else {"content-type": ctype}
    r = client.post("/v1/completions", content=BAD_N, headers=headers)
    if ctype is None:  # the test client adds none for raw content: absent, read as JSON
        assert "content-type" not in r.request.headers
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


@pytest.mark.parametrize(
    ("method", "path", "settings"),
    [
        ("POST", "/v1/completions", {"api_key": "k"}),
        ("POST", "/v1/chat/completions", {"api_key": "k"}),
        ("GET", "/v1/models", {"api_key": "k"}),
        ("GET", "/v1/models/tiny", {"api_key": "k"}),
        ("POST", "/v1/pause", {"admin_token": "t"}),
        ("GET", "/v1/status", {"admin_token": "t"}),
        ("GET", "/v1/is_paused", {"admin_token": "t"}),
        ("POST", "/v1/update_weights", {"admin_token": "t"}),
    ],
)
def test_a_401_names_the_bearer_scheme(
    model: Path, method: str, path: str, settings: dict[str, Any]
) -> None:
    """RFC 9110 §15.5.2: a 401 carries `WWW-Authenticate` with the scheme it wants."""
    c = TestClient(create_app(Settings(model=str(model), max_model_len=64, **settings)))
    for auth in ({}, {"authorization": "Bearer wrong"}):
        r = c.request(method, path, headers=auth, json={} if method == "POST" else None)
        assert r.status_code == 401, r.text
        assert r.headers.get("www-authenticate") == "Bearer"


def test_max_completion_tokens_is_honoured_on_completions(routes: OpenAIRoutes) -> None:
    """Chat's name for max_tokens was ignored on /v1/completions (16 tokens came back for
    `max_completion_tokens: 3`); it is honoured on both routes, and wins over max_tokens."""
    for body, chat in (({"prompt": "hi"}, False), (CHAT, True)):
        assert routes.parse({**body, "max_completion_tokens": 3}, chat).gen.max_tokens == 3
        both = {**body, "max_tokens": 5, "max_completion_tokens": 3}
        assert routes.parse(both, chat).gen.max_tokens == 3
    with pytest.raises(BadRequest) as e:
        routes.parse({"prompt": "hi", "max_completion_tokens": 0}, False)
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(BadRequest) as e:
        routes.parse({"prompt": "hi", "max_completion_tokens": 10_000}, False)  # > context
    assert e.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({**CHAT, "best_of": 2}, True, "best_of"),  # one choice came back, silently
        ({"prompt": "hi", "top_logprobs": 3}, False, "top_logprobs"),  # chat's field
        # a text part without its text was rendered as an empty message
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            True,
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
            True,
            "messages[0].content[0].text",
        ),
    ],
)
def test_fields_that_were_silently_ignored_are_refused(
    routes: OpenAIRoutes, body: dict[str, Any], chat: bool, param: str
) -> None:
    with pytest.raises(BadRequest) as e:
        routes.parse(body, chat)
    assert e.value.code == 400 and e.value.param == param


def test_values_that_ask_for_nothing_still_pass(routes: OpenAIRoutes) -> None:
    routes.parse({**CHAT, "best_of": 1}, True)
    routes.parse({**CHAT, "n": 2, "best_of": 2}, True)
    for top in (None, 0):
        job = routes.parse({"prompt": "hi", "top_logprobs": top, "logprobs": 2}, False)
        assert job.gen.top_logprobs == 2
    assert isinstance(job.gen, m.GenRequest)


def test_a_leading_byte_order_mark_is_ignored(client: TestClient) -> None:
    """RFC 8259 §8.1: a parser may ignore a BOM, and vLLM's does; it was a 400 here."""
    r = client.post("/v1/completions", content=b"\xef\xbb\xbf" + BAD_N)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert parse_json(b"\xef\xbb\xbf") is None  # a BOM alone is a blank body


def test_models_with_a_trailing_slash_is_the_list(client: TestClient) -> None:
    """`/v1/models/` was a 404 for a model named '' (vLLM redirects it to the list)."""
    r = client.get("/v1/models/")
    assert r.status_code == 200, r.text
    assert r.json() == client.get("/v1/models").json()
