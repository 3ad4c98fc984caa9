from __future__ import annotations

import logging

import pytest

from shared.ratelog import RateLimited


def test_a_flood_is_one_line_then_one_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    rl = RateLimited(logging.getLogger("t.ratelog"), every_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t.ratelog"):
        for _ in range(500):
            rl.warning("late", "dropped a request on %s", "ctl.pause")
        rl.warning("other", "ignored a malformed message")  # its own key: not held back
        now[0] += 10
        rl.warning("late", "dropped a request on %s", "ctl.pause")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "dropped a request on ctl.pause",
        "ignored a malformed message",
        "dropped a request on ctl.pause (and 499 more like it in the last 10 s)",
    ]
