"""Shared helpers of the benchmarks: timing, percentiles, result tables, bench.json.

Method (every benchmark): a *run* measures every row of a table once, baselines and ours
interleaved, so load on the machine hits both; a table holds >= 5 runs. A cell is the
median of its runs with their min-max; a ratio is the median of the per-run ratios
(ours / baseline of the same run) with their min-max. A target is checked on the
median ratio and a missed one is reported as ``MISSED`` (see :mod:`tests.bench.report`).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


async def timed(fn: Callable[[], Awaitable[object]], n: int, warmup: int = 20) -> list[float]:
    """Latency of ``n`` sequential calls, in ms (after ``warmup`` untimed ones)."""
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def row(name: str, xs: list[float], base: float | None = None) -> str:
    p50, p99 = statistics.median(xs), pct(xs, 99)
    ratio = f"{p50 / base:.2f}×" if base else "1.00× (baseline)"
    return f"| {name} | {p50:.3f} | {p99:.3f} | {ratio} |"


def table(title: str, rows: list[str], unit: str = "ms") -> str:
    head = (
        f"\n### {title}\n\n| path | p50 {unit} | p99 {unit} | p50 / baseline p50 |\n"
        "|---|---|---|---|"
    )
    return "\n".join([head, *rows])


# --------------------------------------------------------------------------- results

OPS = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b}


@dataclass
class Row:
    """One path of a table: one value per run (p50 ms, MiB/s, tokens/s, seconds...)."""

    name: str
    values: list[float] = field(default_factory=list)
    baseline: str | None = None  # name of the row of the same table it is compared to
    target: tuple[str, float] | None = None  # on the ratio: ("<=", 1.5), (">=", 1.0)
    note: str = ""


@dataclass
class Table:
    id: str
    title: str
    unit: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, **kw: Any) -> Row:
        r = Row(name, **kw)
        self.rows.append(r)
        return r

    def get(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "unit": self.unit,
            "notes": list(self.notes),
            "rows": [self._row_json(r) for r in self.rows],
        }

    def _row_json(self, r: Row) -> dict[str, Any]:
        out: dict[str, Any] = {"name": r.name, "values": list(r.values), "note": r.note}
        out.update(summary(r.values))
        out["baseline"] = r.baseline
        out["ratio"] = None
        if r.baseline and r.values:
            b = self.get(r.baseline)
            if len(b.values) == len(r.values) and all(x > 0 for x in b.values):
                out["ratio"] = summary([v / x for v, x in zip(r.values, b.values, strict=True)])
            elif b.values and statistics.median(b.values) > 0:
                m = statistics.median(r.values) / statistics.median(b.values)
                out["ratio"] = {"median": m, "min": m, "max": m, "n": 1}
        out["target"] = {"op": r.target[0], "value": r.target[1]} if r.target else None
        out["status"] = None
        if r.target:
            ratio = out["ratio"]
            ok = ratio is not None and OPS[r.target[0]](ratio["median"], r.target[1])
            out["status"] = "met" if ok else "MISSED"
        return out


def summary(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def missed(tables: list[dict[str, Any]]) -> list[str]:
    """One line per missed target of the given table dicts."""
    out = []
    for t in tables:
        for r in t["rows"]:
            if r.get("status") == "MISSED":
                ratio = r["ratio"]["median"] if r["ratio"] else float("nan")
                out.append(
                    f"MISSED: {t['title']}: {r['name']}: {ratio:.2f}× vs {r['baseline']} "
                    f"(target {r['target']['op']} {r['target']['value']}×)"
                )
    return out


# --------------------------------------------------------------------------- stacks


# failed stack starts keep their logs here (the bench's own temp dir is removed at its end)
FAILED_LOGS = Path(tempfile.gettempdir()) / "rollbus-bench-failed-starts"


def start_stack_retry(tmp: Any, nats_url: str, attempts: int = 3, **kw: Any) -> Any:
    """:func:`tests.e2e.stack.start_stack`, retried: a stack that is not healthy in time
    (a rank start that is slow or transient on a loaded machine) is stopped, and started
    again, up to ``attempts`` times. Every attempt logs at ``ROLLBUS_LOG_LEVEL=info`` (the
    start phases of each rank; a caller's ``env`` still wins); a failed one's log is kept
    under :data:`FAILED_LOGS` and the warning names it, with how far each rank got."""
    import logging

    from tests.e2e.stack import StackStartError, start_stack

    log = logging.getLogger("bench")
    tp = kw.get("tp", 2)
    kw = {**kw, "env": {"ROLLBUS_LOG_LEVEL": "info", **(kw.get("env") or {})}}
    for i in range(1, attempts + 1):
        t0 = time.perf_counter()
        try:
            stack = start_stack(tmp / f"try{i}", nats_url, **kw)
        except StackStartError as e:
            kept = keep_log(e.log)
            log.warning(
                "stack tp=%s start %d/%d failed after %.0f s (%s); log kept: %s\n%s",
                tp,
                i,
                attempts,
                time.perf_counter() - t0,
                str(e).splitlines()[0],
                kept,
                e.report,
            )
            if i == attempts or e.exited == 2:  # a configuration error: a retry repeats it
                raise
            continue
        log.info("stack tp=%s up in %.1f s (attempt %d)", tp, time.perf_counter() - t0, i)
        return stack
    raise AssertionError("unreachable")


def keep_log(log: Path) -> Path:
    """A copy of ``log`` under :data:`FAILED_LOGS` (named by time and its own name)."""
    FAILED_LOGS.mkdir(parents=True, exist_ok=True)
    dest = FAILED_LOGS / f"{time.strftime('%Y%m%dT%H%M%S')}-{log.name}"
    try:
        shutil.copyfile(log, dest)
    except OSError as e:
        return Path(f"{log} (not copied: {e})")
    return dest
