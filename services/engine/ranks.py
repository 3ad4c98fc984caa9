"""Fan-out from the engine to every worker rank (``rollbus.<i>.worker.ctl.<method>``)."""

from __future__ import annotations

from typing import Any

import msgspec

from shared import messages as m
from shared.bus import Bus
from shared.errors import UNAVAILABLE, ControlError, Timeout
from shared.subjects import Subjects


class RankError(ControlError):
    """Some ranks failed or did not answer; ``replies`` holds the ones that did."""

    def __init__(self, code: int, message: str, replies: dict[int, m.WorkerReply]) -> None:
        super().__init__(code, message)
        self.replies = replies


class Ranks:
    def __init__(self, bus: Bus, subjects: Subjects, tp: int, timeout: float) -> None:
        self.bus, self.subjects, self.tp, self.timeout = bus, subjects, tp, timeout

    async def call(
        self,
        method: str,
        args: msgspec.Struct | None = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> dict[int, m.WorkerReply]:
        """Scatter ``method`` to all ranks; every rank must answer and succeed.

        Raises :class:`RankError`: 503 naming ranks that did not answer, else the first
        failing rank's code with every failing rank's message.
        """
        data = m.json_encode(args) if args is not None else b"{}"
        t = timeout or self.timeout
        try:
            raw = await self.bus.scatter(
                self.subjects.worker_ctl(method),
                data,
                expected=self.tp,
                timeout=t,
                request_id=request_id,
            )
            missing: list[int] = []
        except Timeout as e:
            raw = (e.result or {}).get("replies", {})
            missing = e.missing
        replies = {r: m.json_decode(rep.data, type=m.WorkerReply) for r, rep in raw.items()}
        if missing:
            raise RankError(
                UNAVAILABLE,
                f"{method}: ranks {missing} did not answer within {t:g}s",
                replies,
            )
        failed = sorted((r, rep) for r, rep in replies.items() if rep.error_code != 200)
        if failed:
            by_msg: dict[str, list[int]] = {}
            for r, rep in failed:
                text = rep.error_message.removeprefix(f"rank {r}: ")
                by_msg.setdefault(text, []).append(r)
            msg = "; ".join(
                f"rank {rs[0]}: {text}" if len(rs) == 1 else f"ranks {rs}: {text}"
                for text, rs in by_msg.items()
            )
            raise RankError(failed[0][1].error_code, f"{method} failed: {msg}", replies)
        return replies

    async def broadcast(self, method: str, args: msgspec.Struct | None = None) -> None:
        """Tell every rank without waiting for replies."""
        data = m.json_encode(args) if args is not None else b"{}"
        await self.bus.publish(self.subjects.worker_ctl(method), data)

    async def statuses(self, timeout: float = 1.0) -> list[dict[str, Any]]:
        """Each rank's status, with ``{"rank": r, "alive": False}`` for silent ranks."""
        try:
            replies = await self.call("status", timeout=timeout)
        except RankError as e:
            replies = e.replies
        out = []
        for r in range(self.tp):
            rep = replies.get(r)
            out.append({"alive": True, **rep.result} if rep else {"rank": r, "alive": False})
        return out
