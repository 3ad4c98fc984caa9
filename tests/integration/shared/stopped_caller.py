"""The caller process of ``test_bus_stopped_caller``: connects a :class:`Bus`, makes one
call (``request``, ``scatter`` to 2 ranks, or ``stream``: its first reply) with the
given timeout, and prints one JSON line: the replies' data or the ``Timeout``, and how
long the call took by its own clock (the test stops this process meanwhile).

    python tests/integration/shared/stopped_caller.py URL MODE SUBJECT TIMEOUT
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from shared.bus import Bus
from shared.errors import Timeout


async def call(url: str, mode: str, subject: str, timeout: float) -> dict[str, object]:
    bus = await Bus.connect(url, "stopped-caller")
    pid = str(os.getpid()).encode()  # the responder stops this process on receipt
    t0 = time.monotonic()
    try:
        if mode == "request":
            got = [(await bus.request(subject, pid, timeout=timeout)).data.decode()]
        elif mode == "scatter":
            reps = await bus.scatter(subject, pid, expected=2, timeout=timeout)
            got = [reps[r].data.decode() for r in sorted(reps)]
        else:
            replies = bus.stream(subject, pid, idle_timeout=timeout)
            got = [(await anext(replies)).data.decode()]
            await replies.aclose()
        out: dict[str, object] = {"got": got}
    except Timeout as e:
        out = {"timeout": e.message}
    out["waited"] = time.monotonic() - t0
    await bus.close()
    return out


if __name__ == "__main__":
    url, mode, subject, timeout = sys.argv[1:5]
    print(json.dumps(asyncio.run(call(url, mode, subject, float(timeout)))), flush=True)
