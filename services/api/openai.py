"""OpenAI-compatible generation routes (filled in by the inference issue)."""

from __future__ import annotations

from starlette.routing import Route

from services.api.deps import Deps


def routes(deps: Deps) -> list[Route]:
    return []
