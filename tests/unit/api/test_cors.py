"""Origins listed in ``ROLLBUS_ALLOWED_ORIGINS`` can use the API from a browser: a page's
``fetch`` of a JSON POST is preceded by a CORS preflight (``OPTIONS``) that must be
answered, and the answer must carry ``Access-Control-Allow-Origin`` for the page to read
it. Any other origin gets neither (and its state-changing requests stay 403). Through
the app, without a bus: the preflight and the 403 never reach the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from services.api.app import create_app
from services.tiny_model import create_model_dir
from shared.settings import Settings

ALLOWED = "http://ui.example:3000"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)


def client(model: Path, origins: str) -> TestClient:
    return TestClient(create_app(Settings(model=str(model), allowed_origins=origins)))


PREFLIGHT = {
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type, x-request-id",
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/pause", "/v1/models"])
def test_an_allowed_origin_gets_its_preflight_answered(model: Path, path: str) -> None:
    c = client(model, f"http://other.example, {ALLOWED}")
    r = c.options(path, headers={"origin": ALLOWED, **PREFLIGHT})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = r.headers["access-control-allow-headers"].lower()
    assert all(h in allowed for h in ("authorization", "content-type", "x-request-id"))


def test_an_allowed_origin_can_read_the_answer(model: Path) -> None:
    r = client(model, ALLOWED).get("/v1/models", headers={"origin": ALLOWED})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED


def test_other_origins_get_no_cors_and_stay_refused(model: Path) -> None:
    for origins in ("", ALLOWED):
        c = client(model, origins)
        evil = "http://evil.example"
        r = c.options("/v1/pause", headers={"origin": evil, **PREFLIGHT})
        assert "access-control-allow-origin" not in r.headers
        r = c.get("/v1/models", headers={"origin": evil})
        assert "access-control-allow-origin" not in r.headers
        r = c.post("/v1/pause", headers={"origin": evil})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
