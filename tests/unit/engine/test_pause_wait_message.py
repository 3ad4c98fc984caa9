"""``pause(wait)`` that cannot drain says why: requests still running, or (none left) a
step still in flight — never "0 requests still running" (the audit's contradiction)."""

from __future__ import annotations

import pytest

from shared.errors import ControlError
from tests.unit.engine.test_step_lock import engine


async def test_a_step_in_flight_is_named_not_zero_requests() -> None:
    eng = engine()
    eng.settings.control_timeout_s = 0.05  # the drain's bound, not a speed measurement
    gen = eng.scheduler
    await gen.step_lock.acquire()  # a step out to a rank that does not answer
    try:
        with pytest.raises(ControlError) as e:
            await gen.pause("wait")
    finally:
        gen.step_lock.release()
    assert e.value.code == 503
    msg = e.value.message
    assert "a step still in flight" in msg and "not paused" in msg, msg
    assert "0 requests" not in msg, msg
    assert gen.admit and gen.run  # not paused: it keeps running
