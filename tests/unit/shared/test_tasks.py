"""The supervisor: a failing task is logged, counted, reported and restarted."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import pytest

from shared.tasks import Supervisor, guarded, run_loop


async def test_failure_is_logged_counted_hooked_and_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup = Supervisor("test", backoff=0.01, max_backoff=0.02)
    runs: list[int] = []
    errors: list[BaseException] = []
    forever = asyncio.Event()

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) <= 2:
            raise ValueError(f"boom {len(runs)}")
        await forever.wait()

    async def on_error(e: BaseException) -> None:
        errors.append(e)

    with caplog.at_level(logging.ERROR, logger="rollbus.tasks"):
        sup.start("loop", body, on_error)
        for _ in range(200):
            if len(runs) >= 3:
                break
            await asyncio.sleep(0.01)
    assert len(runs) == 3  # restarted after each failure
    assert sup.failures == {"loop": 2}
    assert [str(e) for e in errors] == ["boom 1", "boom 2"]
    assert sup.report()["last_error"]["loop"] == "ValueError('boom 2')"
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failed) == 2 and all(r.exc_info for r in failed)  # with the traceback
    assert sup.report()["down"] == []
    await sup.stop()
    assert all(t.done() for t in sup.tasks.values())


async def test_a_body_that_returns_is_a_failure_too() -> None:
    sup = Supervisor("test", backoff=0.01)
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs > 1:
            await asyncio.Event().wait()

    sup.start("watch", body)
    for _ in range(100):
        if runs >= 2:
            break
        await asyncio.sleep(0.01)
    assert runs == 2 and sup.failures["watch"] == 1
    await sup.stop()


async def test_backoff_is_reported_down_and_a_failing_hook_does_not_stop_restarts() -> None:
    sup = Supervisor("test", backoff=0.2, max_backoff=0.2)
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        raise RuntimeError("again")

    async def bad_hook(e: BaseException) -> None:
        raise KeyError("hook")

    sup.start("beats", body, bad_hook)
    await asyncio.sleep(0.05)
    assert sup.report()["down"] == ["beats"]
    for _ in range(100):
        if runs >= 3:
            break
        await asyncio.sleep(0.02)
    assert runs >= 3
    await sup.stop()


async def test_cancel_is_not_a_failure() -> None:
    sup = Supervisor("test")
    sup.start("idle", lambda: asyncio.Event().wait())
    await asyncio.sleep(0.01)
    await sup.stop()
    assert sup.failures == {"idle": 0}


async def test_guarded_callback_logs_at_error_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    counts: dict[str, int] = {}

    async def cb(x: int) -> None:
        raise ZeroDivisionError(x)

    with caplog.at_level(logging.ERROR, logger="rollbus.tasks"):
        await guarded("step", cb, counts)(1)
    assert counts == {"step": 1}
    rec = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rec and rec[0].exc_info and "step" in rec[0].getMessage()


async def test_restart_cancels_a_wedged_run_and_counts_it() -> None:
    sup = Supervisor("test", backoff=0.01)
    runs = 0
    errors: list[str] = []

    async def body() -> None:
        nonlocal runs
        runs += 1
        await asyncio.Event().wait()  # wedged

    async def on_error(e: BaseException) -> None:
        errors.append(str(e))

    sup.start("loop", body, on_error)
    await asyncio.sleep(0.02)
    assert sup.restart("loop", "no progress for 31s")
    for _ in range(100):
        if runs >= 2:
            break
        await asyncio.sleep(0.01)
    assert runs == 2 and sup.failures["loop"] == 1
    assert errors == ["task loop restarted: no progress for 31s"]
    assert not sup.tasks["loop"].done()  # the supervisor itself goes on
    await sup.stop()
    assert sup.tasks["loop"].cancelled()


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_stall_s_setting_must_be_a_positive_number(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from pydantic import ValidationError

    from shared.settings import Settings, describe_error

    monkeypatch.delenv("ROLLBUS_STALL_S", raising=False)
    assert Settings().stall_s == 30.0
    monkeypatch.setenv("ROLLBUS_STALL_S", value)
    with pytest.raises(ValidationError) as e:
        Settings()
    assert "ROLLBUS_STALL_S" in describe_error(e.value)


async def _loop_run(done: asyncio.Event) -> tuple[str, int]:
    """What the engine's and a rank's ``amain`` rely on of their loop: a supervised task
    restarted after a failure, a thread's ``call_soon_threadsafe``, a SIGTERM handler."""
    loop = asyncio.get_running_loop()
    sup = Supervisor("test", backoff=0.0)
    runs: list[int] = []

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise ValueError("boom")
        await asyncio.get_running_loop().run_in_executor(None, loop.call_soon_threadsafe, done.set)
        await asyncio.Event().wait()

    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        sup.start("loop", body)
        await done.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        await stop.wait()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        await sup.stop()
    return type(loop).__module__.split(".")[0], len(runs)


@pytest.mark.parametrize("uv", [True, False])
def test_run_loop_is_uvloop_when_importable_else_asyncio(
    uv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a clean install has uvloop (pyproject); without it (hidden here) asyncio's loop
    # serves the same: both must restart a task, take a thread's callback and a SIGTERM
    if not uv:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    kind, runs = run_loop(_loop_run(asyncio.Event()))
    assert (kind, runs) == ("uvloop" if uv else "asyncio", 2)
