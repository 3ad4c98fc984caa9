"""Executes ``rollbus.<i>.worker.step`` on a rank (filled in by the inference issue)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from nats.aio.msg import Msg

from services.worker.control import Rank
from shared.bus import Bus


class Stepper:
    def __init__(self, state: Rank, bus: Bus, pool: ThreadPoolExecutor, rank: int) -> None:
        self.state, self.bus, self.pool, self.rank = state, bus, pool, rank

    async def on_step(self, msg: Msg) -> None:
        return None
