"""The short soak (`just bench soak` runs the long one): mixed control calls with jitter
over NATS and HTTP beside generation streams; nothing lost, crossed, hung or leaked."""

from __future__ import annotations

import asyncio
import time

from tests.bench.soak import soak
from tests.e2e.stack import Stack

MB = 1024 * 1024


def test_short_soak_loses_crosses_hangs_and_leaks_nothing(stack: Stack) -> None:
    res = asyncio.run(soak(stack, calls=300, streams=4, seed=7))
    assert res.calls == 300
    assert res.lost == 0 and res.crossed == 0 and res.hung == 0, res.unexpected[:10]
    assert not res.unexpected, res.unexpected[:10]  # every answer is 200 or 409
    assert sum(res.codes.values()) == 300 and res.codes["200"] > 0
    assert res.latency["http"] and res.latency["nats"]  # both transports were used
    # every generation request got its end: complete or aborted by a pause/sleep
    assert res.streams >= 4 and set(res.stream_ends) <= {"length", "abort"}, res.stream_ends
    assert res.pending == {"engine": 0, "api": 0, "client": 0}, res.pending
    assert set(res.rss_after) >= {"launcher", "engine", "api", "rank 0", "rank 1"}
    for name, before in res.rss_before.items():
        grew = res.rss_after[name] - before
        assert grew < max(32 * MB, before // 5), f"{name}: RSS grew {grew / MB:.1f} MB"
    # a periodic rank ping may be in flight at any moment: a leak stays, a ping ends
    deadline = time.monotonic() + 5
    while (st := stack.status())["bus"]["pending"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert st["state"] == "running" and st["bus"]["pending"] == 0, st["bus"]
