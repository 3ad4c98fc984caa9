"""Prometheus metrics of the API process (``GET /metrics``).

A registry of our own (not the global one) so several apps in one test process do not
collide; engine-side numbers are refreshed from the engine's ``health`` at scrape time.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The label-less gauges, set by ``refresh``: (attribute, metric name, help).
_GAUGES = (
    ("is_paused", "rollbus_is_paused", "1 when generation is paused"),
    ("ranks_alive", "rollbus_ranks_alive", "1 when every rank answers"),
    (
        "version_mismatch",
        "rollbus_rank_version_mismatch",
        "Ranks serving another weight version than the engine",
    ),
    (
        "health_problems",
        "rollbus_health_problems",
        "Reasons /health answers 503 now (stall, stuck rank, mismatch, ...)",
    ),
    (
        "staleness",
        "rollbus_staleness_versions",
        "Versions the serving version is behind the newest announced for the model",
    ),
    ("staleness_bound", "rollbus_staleness_bound", "ROLLBUS_MAX_STALENESS (-1 = no bound)"),
    (
        "staleness_waiting",
        "rollbus_staleness_waiting",
        "New requests waiting because the serving version is over their staleness bound",
    ),
)


class Metrics:
    is_paused: Gauge
    ranks_alive: Gauge
    version_mismatch: Gauge
    health_problems: Gauge
    staleness: Gauge
    staleness_bound: Gauge
    staleness_waiting: Gauge

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.control_requests = Counter(
            "rollbus_control_requests",
            "Control calls by method and status code",
            ["method", "code"],
            registry=r,
        )
        self.control_latency = Histogram(
            "rollbus_control_latency_seconds",
            "Control call latency through the bus",
            ["method"],
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5, 10, 60),
        )
        self.gen_requests = Counter(
            "rollbus_generation_requests",
            "Generation requests by route and outcome",
            ["route", "finish_reason"],
            registry=r,
        )
        # a request answered with an error: its HTTP status, or the code of a stream's
        # error event (a step failure, an engine lost mid-stream); 499 = the client left
        self.gen_errors = Counter(
            "rollbus_generation_errors",
            "Generation requests answered with an error, by route and status code",
            ["route", "code"],
            registry=r,
        )
        self.gen_tokens = Counter(
            "rollbus_generation_tokens",
            "Tokens generated",
            registry=r,
        )
        self.ttft = Histogram(
            "rollbus_time_to_first_token_seconds",
            "Time to first token",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
        )
        self.weight_version = Gauge(
            "rollbus_weight_version_info", "The serving weight version", ["version"], registry=r
        )
        for attr, name, doc in _GAUGES:
            setattr(self, attr, Gauge(name, doc, registry=r))
        # a count that only grows is a counter (exposed as ``…_total``), moved to the
        # bus's own total at each scrape (it was a gauge: rate() and increase() refused it)
        self.dropped_replies = Counter(
            "rollbus_bus_dropped_replies",
            "Late or unknown replies dropped by the API's bus",
            registry=r,
        )
        self._dropped_last = 0
        self.task_failures = Counter(
            "rollbus_task_failures",
            "Supervised long-running tasks that failed (and were restarted)",
            ["process", "task"],
            registry=r,
        )
        self.callback_errors = Counter(
            "rollbus_callback_errors",
            "Exceptions raised inside NATS callbacks (logged at ERROR)",
            ["process", "callback"],
            registry=r,
        )
        # (counter, process, name) -> (pid of the process that counted, its total)
        self._seen: dict[tuple[int, str, str], tuple[int, float]] = {}
        self._control_children: dict[tuple[str, int], Any] = {}

    def control(self, method: str, code: int) -> None:
        child = self._control_children.get((method, code))
        if child is None:  # label lookup once per (method, code), not per call
            child = self.control_requests.labels(method, str(code))
            self._control_children[(method, code)] = child
        child.inc()

    def _count(self, counter: Counter, process: str, name: str, total: float, pid: int = 0) -> None:
        """Move ``counter`` to a total counted elsewhere. A restarted process (another
        ``pid``; without one: a total that went down) counts from 0 again: all its total
        is new, so the counter never goes back nor loses what the new process counted
        before the first scrape that saw it."""
        key = (id(counter), process, name)
        last_pid, last = self._seen.get(key, (pid, 0.0))
        self._seen[key] = (pid, total)
        restarted = (pid and last_pid and pid != last_pid) or total < last
        counter.labels(process, name).inc(total if restarted else total - last)

    def refresh(
        self,
        health: dict[str, Any] | None,
        dropped: int,
        callback_errors: dict[str, int] | None = None,
    ) -> None:
        # a total below the last one is a new bus (counting from 0): all of it is new
        self.dropped_replies.inc(
            dropped if dropped < self._dropped_last else dropped - self._dropped_last
        )
        self._dropped_last = dropped
        for name, n in (callback_errors or {}).items():
            self._count(self.callback_errors, "api", name, n)
        if not health:
            # the engine did not answer (stopped, restarting, NATS away): /health is 503
            # for that reason, so it counts as one; nothing is known alive
            self.ranks_alive.set(0)
            self.health_problems.set(1)
            return
        pid = int(health.get("pid") or 0)
        for name, n in (health.get("tasks") or {}).get("failures", {}).items():
            self._count(self.task_failures, "engine", name, n, pid)
        for name, n in (health.get("callback_errors") or {}).items():
            self._count(self.callback_errors, "engine", name, n, pid)
        for rank, h in (health.get("ranks_health") or {}).items():
            rpid = int(h.get("pid") or 0)
            for name, n in (h.get("task_failures") or {}).items():
                self._count(self.task_failures, f"rank{rank}", name, n, rpid)
            for name, n in (h.get("callback_errors") or {}).items():
                self._count(self.callback_errors, f"rank{rank}", name, n, rpid)
        self.version_mismatch.set(len(health.get("version_mismatch") or []))
        self.health_problems.set(len(health.get("problems") or []))
        self.is_paused.set(0 if health.get("state") == "running" else 1)
        self.ranks_alive.set(1 if health.get("ranks_alive") else 0)
        stale = health.get("staleness") or {}
        self.staleness.set(int(stale.get("behind", 0)))
        bound = stale.get("max_staleness")
        self.staleness_bound.set(-1 if bound is None else int(bound))
        self.staleness_waiting.set(int(stale.get("waiting", 0)))
        self.weight_version.clear()
        self.weight_version.labels(str(health.get("weight_version", ""))).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
