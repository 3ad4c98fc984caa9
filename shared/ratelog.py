"""Warnings a remote party can trigger at will (a late request, a malformed message) are
logged at most once per key every ``every_s`` seconds, with how many were held back: a
client cannot flood a service's log, and an operator still sees that it happens."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RateLimited"]


class RateLimited:
    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        """``logger.warning(msg, *args)`` unless ``key`` was logged in the last
        ``every_s`` seconds (then counted, and said with the next one)."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return
        if len(self._last) > 1024:  # keys are few (subjects, kinds): never grows unbounded
            self._last.clear()
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            msg += " (and %d more like it in the last %.0f s)"
            args = (*args, held, now - last if last is not None else self.every_s)
        self.logger.warning(msg, *args)
