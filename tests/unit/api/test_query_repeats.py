"""A control query parameter given more than once: only ``tags`` (a list) may repeat and
is joined; any other is 400 naming it, never joined into one value (``version=a&version=b``
asked for version ``a,b``) nor decided by the last one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from services.api.app import create_app
from shared.settings import Settings


@pytest.fixture(autouse=True)
def _model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 128}')
    monkeypatch.setenv("ROLLBUS_MODEL", str(tmp_path))
    monkeypatch.setenv("ROLLBUS_DATA_DIR", str(tmp_path / "data"))


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("/v1/pause?mode=keep&mode=abort", "mode"),
        ("/v1/update_weights?version=a&version=b", "version"),
        ("/v1/update_weights?version=v1&verify_checksum=true&verify_checksum=false",
         "verify_checksum"),
    ],
)  # fmt: skip
def test_a_repeated_parameter_is_400_naming_it(
    calls: list[tuple[str, dict[str, Any]]], query: str, param: str
) -> None:
    r = TestClient(create_app(Settings())).post(query)
    assert r.status_code == 400, r.text
    assert r.json()["result"] == {"param": param} and "2 times" in r.json()["error_message"]
    assert calls == []  # nothing ran


def test_tags_may_repeat_and_blank_repeats_are_absent(
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    c = TestClient(create_app(Settings()))
    assert c.post("/v1/sleep?tags=weight&tags=kv_cache").status_code == 200
    assert c.post("/v1/pause?mode=&mode=keep").status_code == 200  # an empty one is absent
    assert calls == [("sleep", {"tags": "weight,kv_cache"}), ("pause", {"mode": "keep"})]
