"""The launcher's restart budget: at most N restarts of one process per window."""

from __future__ import annotations

from services.launcher import RestartBudget


def test_budget_per_process_and_window() -> None:
    b = RestartBudget(limit=2, window=60.0)
    assert b.take("engine", 0.0) and b.take("engine", 10.0)
    assert not b.take("engine", 20.0)  # third within 60 s
    assert b.take("worker ranks", 20.0)  # another process has its own budget
    assert b.take("engine", 60.5)  # the first one left the window
    assert not RestartBudget(limit=0).take("api")
