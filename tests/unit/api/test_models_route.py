"""``GET /v1/models`` and ``GET /v1/models/{model}`` (the official client's
``models.list()`` / ``models.retrieve(id)``), and the JSON of unknown routes: OpenAI's
error shape, ``param`` included. Through the app, without a bus (these routes need none)."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from services.api.app import create_app
from services.tiny_model import create_model_dir
from shared.settings import Settings


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    # not entered as a context manager: no lifespan, so no bus is connected
    return TestClient(create_app(Settings(model=str(model), max_model_len=64)))


def test_a_served_model_is_retrieved_by_its_id(client: TestClient) -> None:
    (listed,) = client.get("/v1/models").json()["data"]
    r = client.get("/v1/models/tiny")
    assert r.status_code == 200
    assert r.json() == listed
    assert listed["id"] == "tiny" and listed["object"] == "model"
    assert listed["max_model_len"] == 64


@pytest.mark.parametrize("name", ["other", "tiny/x", "org/tiny"])
def test_another_model_is_404_in_openai_shape(client: TestClient, name: str) -> None:
    r = client.get(f"/v1/models/{name}")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == 404 and err["param"] == "model" and name in err["message"]
    assert err["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [("GET", "/nope", 404), ("GET", "/v1", 404), ("GET", "/v1/completions", 405)],
)
def test_unknown_routes_and_wrong_methods_answer_openai_shape(
    client: TestClient, method: str, path: str, code: int
) -> None:
    r = client.request(method, path)
    assert r.status_code == code
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code


@pytest.mark.parametrize("path", ["/clear_load_weight", "/update_model_weight"])
def test_head_on_a_state_changing_get_changes_nothing(client: TestClient, path: str) -> None:
    """HEAD is safe (RFC 9110): a ``curl -I`` or a link checker must not put the engine to
    sleep or wake it. These GETs act, so their HEAD is 405 (Allow: GET), never sent on."""
    r = client.head(path)  # no bus here: a call to the engine would fail (500)
    assert r.status_code == 405 and r.headers["allow"] == "GET"
