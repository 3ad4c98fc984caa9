"""The engine answers its pure reads in the subscription callback (``INLINE``): each must
be a plain function that never awaits and takes no lock, else one call would hold back
every later one on its subject."""

from __future__ import annotations

import inspect

from services.engine.main import INLINE, METHODS


def test_inline_reads_never_await() -> None:
    assert INLINE  # is_paused, the polled call, is among them
    assert "is_paused" in INLINE
    for method in INLINE:
        fn, _, exclusive = METHODS[method]
        assert not exclusive, method
        assert not inspect.iscoroutinefunction(fn), method
        assert not inspect.isasyncgenfunction(fn), method


def test_status_runs_in_its_own_task() -> None:
    # a fresh status scatters to the ranks: answered inline it would hold back the next
    assert "status" not in INLINE
    assert inspect.iscoroutinefunction(METHODS["status"][0])
