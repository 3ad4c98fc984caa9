"""``/metrics`` numbers the API turns from the engine's ``health`` (counted in other
processes) into Prometheus counters and gauges: counters never go back and lose nothing
across a restart of the process that counted; gauges do not keep a healthy value while
the engine does not answer."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.api.metrics import Metrics


def health(pid: int, step_loop: int, rank_pid: int = 7, watchdog: int = 0) -> dict[str, Any]:
    return {
        "pid": pid,
        "tasks": {"failures": {"step_loop": step_loop}},
        "ranks_health": {"0": {"pid": rank_pid, "task_failures": {"step_watchdog": watchdog}}},
        "problems": [],
        "state": "running",
        "ranks_alive": True,
        "weight_version": "v0",
    }


def value(m: Metrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def failures(m: Metrics, process: str, task: str) -> float:
    return value(m, "rollbus_task_failures_total", process=process, task=task)


def test_a_restarted_engine_counts_on_top_of_the_old_one() -> None:
    m = Metrics()
    m.refresh(health(pid=100, step_loop=2), 0)
    assert failures(m, "engine", "step_loop") == 2
    # the engine died and its successor failed twice too before the next scrape: the
    # same total, but 2 new failures (was: unchanged, they were lost)
    m.refresh(health(pid=200, step_loop=2), 0)
    assert failures(m, "engine", "step_loop") == 4
    m.refresh(health(pid=200, step_loop=3), 0)
    assert failures(m, "engine", "step_loop") == 5


def test_a_restarted_rank_counts_on_top_of_the_old_one() -> None:
    m = Metrics()
    m.refresh(health(100, 0, rank_pid=7, watchdog=1), 0)
    m.refresh(health(100, 0, rank_pid=8, watchdog=1), 0)
    assert failures(m, "rank0", "step_watchdog") == 2


def test_a_total_that_went_down_is_a_restart_without_pids() -> None:
    m = Metrics()
    for total in (3, 1, 2):
        h = health(0, total)
        del h["pid"]
        m.refresh(h, 0)
    assert failures(m, "engine", "step_loop") == 3 + 1 + 1


def test_an_engine_that_does_not_answer_is_a_health_problem() -> None:
    m = Metrics()
    m.refresh(health(100, 0), 0)
    assert value(m, "rollbus_health_problems") == 0
    assert value(m, "rollbus_ranks_alive") == 1
    m.refresh(None, 0)  # /health is 503 now: the gauges must not say all is well
    assert value(m, "rollbus_health_problems") == 1
    assert value(m, "rollbus_ranks_alive") == 0
    # and the whole text stays what a Prometheus scraper parses
    assert {f.name for f in text_string_to_metric_families(m.render().decode())} >= {
        "rollbus_health_problems",
        "rollbus_task_failures",
    }


def test_dropped_replies_is_a_counter_that_never_goes_back() -> None:
    """A count that only grows is exposed as a Prometheus counter (``…_total``: rate()
    and increase() work on it); it was a gauge. A new bus (its total from 0 again) counts
    on top."""
    m = Metrics()
    for total in (3, 5, 1):
        m.refresh(health(100, 0), total)
    assert value(m, "rollbus_bus_dropped_replies_total") == 5 + 1
    text = m.render().decode()
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds["rollbus_bus_dropped_replies"] == "counter"
    assert "# TYPE rollbus_bus_dropped_replies gauge" not in text
