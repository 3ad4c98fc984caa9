"""Shared helpers of the benchmarks: timing, percentiles, tables, stacks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


async def timed(fn: Callable[[], Awaitable[object]], n: int, warmup: int = 20) -> list[float]:
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
