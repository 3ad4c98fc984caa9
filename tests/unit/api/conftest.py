"""Fixtures shared by the API's unit tests."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.api.deps import Deps
from shared import messages as m


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Control calls the API sends, recorded (method, args) and answered 200."""
    seen: list[tuple[str, dict[str, Any]]] = []

    async def control(self: Deps, method: str, data: bytes, rid: str, **kw: Any) -> m.ControlReply:
        seen.append((method, json.loads(data or b"{}")))
        return m.ControlReply(rid, 200, "", {})

    monkeypatch.setattr(Deps, "control", control)
    return seen
