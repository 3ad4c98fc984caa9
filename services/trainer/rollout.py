"""The rollout side's ``state_dict()`` as a trainer sees it: every rank's tensors by
inference name (shape, dtype), from the ranks themselves (``worker.ctl.state_dict``)."""

from __future__ import annotations

import asyncio
from typing import Any

from shared import messages as m
from shared.bus import Bus
from shared.subjects import Subjects


async def astate_dict(
    nats_url: str, instance: str, tp: int, timeout: float = 10.0
) -> dict[int, dict[str, Any]]:
    bus = await Bus.connect(nats_url, "rollbus-state-dict")
    try:
        reps = await bus.scatter(
            Subjects(instance).worker_ctl("state_dict"), b"{}", expected=tp, timeout=timeout
        )
    finally:
        await bus.close()
    out = {}
    for r, rep in sorted(reps.items()):
        wr = m.json_decode(rep.data, type=m.WorkerReply)
        out[r] = wr.result if wr.error_code == 200 else {"error": wr.error_message}
    return out


def rollout_state_dict(
    nats_url: str, instance: str = "default", tp: int = 2
) -> dict[int, dict[str, Any]]:
    """``{rank: {"version", "tensors": {inference name: {"shape", "dtype"}}}}``."""
    return asyncio.run(astate_dict(nats_url, instance, tp))
