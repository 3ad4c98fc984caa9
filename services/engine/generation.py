"""Generation side of the engine: what pause/resume/sleep/update act on.

Until the inference issue lands, the engine has no scheduler: ``rollbus.<i>.gen``
answers 501 and pause modes only gate admission.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from nats.micro.service import Service

if TYPE_CHECKING:
    from services.engine.main import Engine


class Generation:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def start(self, svc: Service) -> None:
        return None

    def background(self) -> list[asyncio.Task[Any]]:
        return []

    async def pause(self, mode: str) -> int:
        """Stop scheduling; returns how many requests were aborted."""
        return 0

    def resume(self) -> None:
        return None

    def drop_kv(self) -> None:
        return None

    def restore_kv(self) -> None:
        return None

    def weights_changed(self, version: str) -> None:
        return None

    def counts(self) -> dict[str, int]:
        return {"waiting": 0, "running": 0, "kept": 0}
