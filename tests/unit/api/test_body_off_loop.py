"""A request body is parsed and checked off the API's event loop: a 4 MiB body of a
million tiny JSON values costs seconds of CPU in ``json.loads`` + ``check_tree`` (seen
over HTTP: every other request — streams, control, ``/health`` — waited 23 s behind one
such POST). The routes run with starlette's TestClient; the check is which thread runs
``check_tree``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from services.api import body as body_mod
from services.api.app import create_app
from services.api.body import BadRequest
from shared.settings import Settings


@pytest.fixture
def on_loop(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each ``check_tree`` call ran on an event loop's thread; it then refuses the
    body (400 naming ``probe``) so that nothing else is needed."""
    seen: list[bool] = []

    def probe(doc: Any, *a: Any, **kw: Any) -> None:
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)
        raise BadRequest("probe", "probe")

    monkeypatch.setattr(body_mod, "check_tree", probe)
    return seen


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    from services.tiny_model import create_model_dir

    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    return TestClient(create_app(Settings(model=str(model))))


# big enough to be worth a thread on every route (control routes parse small bodies inline)
BIG = json.dumps({"prompt": "x", "pad": [[] for _ in range(100_000)]}).encode()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/pause"])
def test_a_big_body_is_parsed_off_the_event_loop(
    client: TestClient, on_loop: list[bool], path: str
) -> None:
    r = client.post(path, content=BIG, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "probe" in r.text
    assert on_loop == [False]
