"""The API SIGKILLed: the engine stops generating for the requests it was serving (nobody
can read their tokens any more) instead of running them on to ``max_tokens``."""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults import common as c
from tests.faults.common import Faults

pytestmark = pytest.mark.faults

ORPHAN_BOUND = c.ORPHAN_BOUND


def test_api_killed_its_requests_stop_in_the_engine(faults: Faults) -> None:
    f = faults
    # two long streams: ~1500 tokens each would run for tens of seconds on the tiny model
    streams = [c.Stream(f.stack) for _ in range(2)]
    for s in streams:
        assert s.started.wait(c.GEN_BOUND)
    assert c.engine_requests(f.stack) == 2
    before = c.log_count(f.stack, "nobody reads")
    api = c.child_pid(f.stack.proc.pid, "services.api")
    c.signal_quietly(api, signal.SIGKILL)
    killed = time.monotonic()
    for s in streams:
        assert s.result().outcome == "cut", (s.outcome, s.error)
    while (n := c.engine_requests(f.stack)) != 0:
        assert time.monotonic() - killed < ORPHAN_BOUND, f"{n} requests still in the engine"
        time.sleep(0.2)
    assert c.log_count(f.stack, "nobody reads") > before  # cancelled, not finished
