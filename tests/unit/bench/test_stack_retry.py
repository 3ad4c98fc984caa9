"""`just bench` completes when a stack start is transient: every part that starts a
stack retries it; a failed attempt's log is kept (path in the bench log) with how far
each rank got, and every attempt logs at ROLLBUS_LOG_LEVEL=info (the ranks' phases)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import tests.e2e.stack as stack_mod
from tests.bench import common, soak
from tests.e2e.stack import StackStartError, start_report

# a TP=4 start that stopped in the comm group: the lines the ranks and the launcher write
# (paddle's logging format, as the ranks' INFO lines come out)
HUNG_LOG = """\
2026-12-01 18:15:44,214 api INFO rollbus.api: serving with loop=uvloop http=httptools
[18:15:54,754] [    INFO] main.py:109 - rank 3 start: joining the comm group of 4 ranks
[18:15:56,180] [    INFO] main.py:109 - rank 1 start: joining the comm group of 4 ranks
rollbus-worker rank 0: start failed: [pair.cc:784] connect [127.0.0.1]:8065: Connection refused
rollbus: worker rank 0 failed to start (exit code 3); restarting the ranks (1/2)
[18:15:56,749] [    INFO] main.py:109 - rank 0 start: joining the comm group of 4 ranks
[18:16:01,769] [    INFO] main.py:114 - rank 1 start: comm group joined; loading the weights
[18:16:01,875] [    INFO] main.py:295 - rank 1 ready: version v0
"""


class _Stack:
    def stop(self) -> None:
        pass


def test_start_report_names_each_ranks_last_phase(tmp_path: Path) -> None:
    log = tmp_path / "stack.log"
    log.write_text(HUNG_LOG)
    lines = start_report(log, 4, "503 engine not ready: waiting for the ranks").splitlines()
    assert lines[:4] == [
        "rank 0: start: joining the comm group of 4 ranks",
        "rank 1: ready: version v0",
        "rank 2: no start phase logged (importing paddle / connecting)",
        "rank 3: start: joining the comm group of 4 ranks",
    ]
    assert any("restarting the ranks (1/2)" in ln for ln in lines)
    assert any("Connection refused" in ln for ln in lines)
    assert lines[-1] == "/health: 503 engine not ready: waiting for the ranks"


def test_soak_part_retries_a_stack_that_did_not_come_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[Path, dict[str, Any]]] = []

    def flaky(tmp: Path, url: str, **kw: Any) -> _Stack:
        calls.append((tmp, kw))
        if len(calls) == 1:
            tmp.mkdir(parents=True)
            log = tmp / "stack-t1.log"
            log.write_text(HUNG_LOG)
            raise StackStartError("rollbus serve not healthy in 120s:", log, start_report(log, 4))
        return _Stack()

    async def fake_soak(stack: Any, calls_: int, streams: int, **kw: Any) -> str:
        return "measured"

    monkeypatch.setattr(stack_mod, "start_stack", flaky)
    monkeypatch.setattr(common, "FAILED_LOGS", tmp_path / "kept")
    monkeypatch.setattr(soak, "soak", fake_soak)
    monkeypatch.setattr(soak, "report", lambda res, title: f"{title}: {res}")
    with caplog.at_level(logging.WARNING, logger="bench"):
        out = soak.run(tmp_path, "nats://127.0.0.1:1", calls=10, streams=1)
    assert out.endswith(": measured") and len(calls) == 2
    assert calls[0][0] != calls[1][0]  # a fresh dir per attempt
    assert all(kw["env"]["ROLLBUS_LOG_LEVEL"] == "info" for _, kw in calls)
    assert "start 1/3 failed" in caplog.text and "not healthy in 120s" in caplog.text
    assert "rank 2: no start phase logged" in caplog.text
    kept = list((tmp_path / "kept").iterdir())
    assert len(kept) == 1 and kept[0].read_text() == HUNG_LOG
    assert str(kept[0]) in caplog.text  # the warning says where the log is


def test_a_callers_log_level_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, str]] = []

    def ok(tmp: Path, url: str, **kw: Any) -> _Stack:
        seen.append(kw["env"])
        return _Stack()

    monkeypatch.setattr(stack_mod, "start_stack", ok)
    common.start_stack_retry(
        tmp_path, "nats://127.0.0.1:1", tp=4, env={"ROLLBUS_LOG_LEVEL": "debug", "X": "1"}
    )
    assert seen == [{"ROLLBUS_LOG_LEVEL": "debug", "X": "1"}]


def test_a_configuration_error_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def refused(tmp: Path, url: str, **kw: Any) -> _Stack:
        calls.append(tmp)
        log = tmp_path / f"stack-{len(calls)}.log"
        log.write_text("rollbus: ROLLBUS_MODEL=…: unsupported model config\n")
        raise StackStartError("rollbus serve exited with 2:", log, "", exited=2)

    monkeypatch.setattr(stack_mod, "start_stack", refused)
    monkeypatch.setattr(common, "FAILED_LOGS", tmp_path / "kept")
    with pytest.raises(StackStartError):
        common.start_stack_retry(tmp_path, "nats://127.0.0.1:1", tp=3)
    assert len(calls) == 1  # exit code 2 is never transient
