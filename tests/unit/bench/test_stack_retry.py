"""`just bench` completes when a stack start is transient: every part that starts a
stack retries it, with the failure's log tail in the bench log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import tests.e2e.stack as stack_mod
from tests.bench import soak


class _Stack:
    def stop(self) -> None:
        pass


def test_soak_part_retries_a_stack_that_did_not_come_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Path] = []

    def flaky(tmp: Path, url: str, **kw: Any) -> _Stack:
        calls.append(tmp)
        if len(calls) == 1:
            raise RuntimeError("rollbus serve not healthy in 120s:\nrank 3 still loading")
        return _Stack()

    async def fake_soak(stack: Any, calls_: int, streams: int, **kw: Any) -> str:
        return "measured"

    monkeypatch.setattr(stack_mod, "start_stack", flaky)
    monkeypatch.setattr(soak, "soak", fake_soak)
    monkeypatch.setattr(soak, "report", lambda res, title: f"{title}: {res}")
    with caplog.at_level(logging.WARNING, logger="bench"):
        out = soak.run(tmp_path, "nats://127.0.0.1:1", calls=10, streams=1)
    assert out.endswith(": measured") and len(calls) == 2
    assert calls[0] != calls[1]  # a fresh dir per attempt
    assert "stack start 1/3 failed" in caplog.text and "rank 3 still loading" in caplog.text
