"""Supervised long-running tasks: none of them may end unobserved.

:class:`Supervisor` runs each task body in a loop. An unexpected exception (or a body
that returns although it should run forever) is logged at ERROR with its traceback,
counted per task name (``failures``, turned into ``rollbus_task_failures_total`` by the
API), handed to the task's ``on_error`` hook (e.g. fail the in-flight requests with
503), and the body restarts after a backoff that doubles up to ``max_backoff`` and
resets once a run has lasted ``healthy_after`` seconds. Cancellation ends it quietly.

:func:`guarded` wraps a NATS callback the same way, minus the restart: nats-py hands a
callback's exception to the connection's error callback, where it used to be lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("rollbus.tasks")

T = TypeVar("T")
Body = Callable[[], Awaitable[Any]]
OnError = Callable[[BaseException], Awaitable[None]]


class Supervisor:
    def __init__(
        self,
        process: str,
        *,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        healthy_after: float = 30.0,
    ) -> None:
        self.process = process
        self.backoff, self.max_backoff, self.healthy_after = backoff, max_backoff, healthy_after
        self.failures: dict[str, int] = {}
        self.last_error: dict[str, str] = {}
        self.down: set[str] = set()  # tasks waiting out their backoff
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._inner: dict[str, asyncio.Future[Any]] = {}
        self._kicked: dict[str, str] = {}

    def start(self, name: str, body: Body, on_error: OnError | None = None) -> asyncio.Task[None]:
        self.failures.setdefault(name, 0)
        task = asyncio.create_task(self._run(name, body, on_error), name=name)
        self.tasks[name] = task
        return task

    def restart(self, name: str, reason: str) -> bool:
        """Cancel the current run of ``name`` (wedged, e.g. a stall) and count it as a
        failure: the error hook runs and the body starts again. False if not running."""
        inner = self._inner.get(name)
        if inner is None or inner.done():
            return False
        self._kicked[name] = reason
        inner.cancel()
        return True

    async def _run(self, name: str, body: Body, on_error: OnError | None) -> None:
        delay = self.backoff
        while True:
            t0 = time.monotonic()
            inner = self._inner[name] = asyncio.ensure_future(body())
            try:
                await inner
                err: BaseException = RuntimeError(f"task {name} returned")
                log.error("%s: task %s ended unexpectedly; restarting", self.process, name)
            except asyncio.CancelledError:
                reason = self._kicked.pop(name, None)
                if reason is None or not inner.cancelled():
                    inner.cancel()
                    raise
                err = RuntimeError(f"task {name} restarted: {reason}")
                log.error("%s: task %s restarted: %s", self.process, name, reason)
            except Exception as e:  # noqa: BLE001 - the point: never lost, always restarted
                err = e
                log.exception("%s: task %s failed; restarting", self.process, name)
            self.failures[name] = self.failures.get(name, 0) + 1
            self.last_error[name] = repr(err)
            if time.monotonic() - t0 >= self.healthy_after:
                delay = self.backoff
            self.down.add(name)
            try:
                if on_error is not None:
                    try:
                        await on_error(err)
                    except asyncio.CancelledError:
                        raise
                    except Exception:  # noqa: BLE001 - the restart must still happen
                        log.exception("%s: error hook of task %s failed", self.process, name)
                await asyncio.sleep(delay)
            finally:
                self.down.discard(name)
            delay = min(delay * 2, self.max_backoff)

    async def stop(self) -> None:
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def report(self) -> dict[str, Any]:
        """What ``health`` carries: failure counts, last errors, tasks down right now."""
        return {
            "failures": dict(self.failures),
            "last_error": dict(self.last_error),
            "down": sorted(self.down),
        }


def guarded(
    name: str, cb: Callable[[T], Awaitable[None]], counts: dict[str, int] | None = None
) -> Callable[[T], Coroutine[Any, Any, None]]:
    """``cb`` whose exceptions are logged at ERROR with the traceback (and counted in
    ``counts[name]``) instead of reaching nats-py's error callback."""

    async def run(arg: T) -> None:
        try:
            await cb(arg)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged loudly, never swallowed silently
            log.exception("callback %s failed", name)
            if counts is not None:
                counts[name] = counts.get(name, 0) + 1

    return run


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop when it is importable (a runtime dependency; no
    Windows or PyPy build): the engine's and a rank's event loops handle a message per
    step each way, and on two cores every CPU-second they take comes out of the ranks'
    compute (``tests.bench.api_cpu --extra-path`` measured the difference)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
