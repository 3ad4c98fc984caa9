"""Who takes the CPU from a rank's compute threads: ``selfbench`` against served runs.

``python -m tests.bench.preempt_trace [--tp 1] [--runs 3] [--variants JSON]`` (root:
``perf record -e sched:sched_switch``; tracefs mounted) starts one stack per variant on its
own nats-server and runs, interleaved, ``selfbench`` with prefill (the same work as a
served batch) and ``batch`` concurrent ``/v1/completions``, each under a system-wide
trace of context switches. For rank 0's two busiest threads (paddle's compute thread and
its OpenMP worker at TP=1) it prints, per run: the time they were runnable but off the CPU
(preempted, state R), attributed to whoever took the CPU — the stack's own processes
(engine, api, nats-server, the bench client, rank 0's other threads) or anything else on
the host (``foreign``, other helpers' jobs on a shared machine) —, and for time lost to
the stack, the share during which the other compute thread was on a CPU (it then spins at
OpenMP's next barrier: the preemption stalls the step, not one core of it). Load on the
host shows as ``foreign`` and is kept apart from what the stack does to itself."""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import re
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from services import natsd
from shared.bus import Bus
from shared.subjects import Subjects
from tests.bench import gen_where as gw
from tests.bench import generation as g

SWITCH = re.compile(
    r"^\s*(\d+\.\d+):\s+sched:sched_switch:.*?prev_pid=(\d+) .*?prev_state=(\S+)"
    r" ==> .*?next_pid=(\d+) "
)


def tids(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def owners(procs: dict[str, int], compute: list[int]) -> dict[int, str]:
    """tid -> the stack's role that owns it (rank 0's non-compute threads: ``rank 0 other``)."""
    out: dict[int, str] = {}
    for name, pid in procs.items():
        for t in tids(pid):
            out[t] = f"{name} other" if name == "rank 0" else name
    for t in compute:
        out[t] = "compute"
    return out


def analyse(trace: str, compute: list[int], own: dict[int, str]) -> dict[str, Any]:
    """Preempted time of each compute thread by who took its CPU, and for time taken by
    the stack, how much of it the other compute thread spent on a CPU."""
    on: dict[int, bool] = {t: False for t in compute}
    off_since: dict[int, tuple[float, str]] = {}
    by: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    stack_lost = 0.0
    stack_other_on = 0.0
    # each compute thread's on-CPU intervals: did the other one run while one was off
    intervals: dict[int, list[tuple[float, float]]] = {t: [] for t in compute}
    on_since: dict[int, float] = {}
    preempted: list[tuple[int, float, float, str]] = []
    for line in trace.splitlines():
        mt = SWITCH.match(line)
        if not mt:
            continue
        ts, prev, state, nxt = float(mt[1]), int(mt[2]), mt[3], int(mt[4])
        if prev in on:
            on[prev] = False
            if prev in on_since:
                intervals[prev].append((on_since.pop(prev), ts))
            if state.startswith("R"):
                off_since[prev] = (ts, own.get(nxt, "foreign"))
        if nxt in on:
            on[nxt] = True
            on_since[nxt] = ts
            if nxt in off_since:
                t0, who = off_since.pop(nxt)
                preempted.append((nxt, t0, ts, who))
    for tid, t0, t1, who in preempted:
        by[who] += t1 - t0
        count[who] += 1
        if who not in ("foreign", "compute"):
            stack_lost += t1 - t0
            other = [o for o in compute if o != tid]
            for o in other:
                ends = [b for _, b in intervals[o]]
                j = bisect.bisect_right(ends, t0)  # the first interval ending after t0
                while j < len(ends) and intervals[o][j][0] < t1:
                    a, b = intervals[o][j]
                    stack_other_on += min(b, t1) - max(a, t0)
                    j += 1
    return {
        "preempted_s": {k: round(v, 3) for k, v in sorted(by.items())},
        "preemptions": dict(sorted(count.items())),
        "by_stack_s": round(stack_lost, 3),
        "by_stack_other_on_cpu_s": round(stack_other_on, 3),
    }


async def traced(coro: Any, out: Path) -> tuple[Any, str, float]:
    rec = subprocess.Popen(
        ["perf", "record", "-q", "-a", "-e", "sched:sched_switch", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    await asyncio.sleep(1.0)  # perf attached
    t0 = time.perf_counter()
    res = await coro
    wall = time.perf_counter() - t0
    rec.send_signal(2)
    rec.wait(timeout=60)
    text = subprocess.run(
        ["perf", "script", "-i", str(out), "-F", "time,event,trace"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    out.unlink(missing_ok=True)
    return res, text, wall


async def main_async(args: argparse.Namespace, tmp: Path) -> None:
    model_dir = Path(args.model_dir)
    variants: dict[str, dict[str, str]] = json.loads(args.variants)
    server = natsd.start(tmp / "nats", port=0)
    bus = await Bus.connect(server.url, "preempt-trace")
    stacks = {}
    res: dict[str, list[float]] = defaultdict(list)
    try:
        procs = await gw.start_variants(stacks, variants, tmp, server, model_dir, args)
        for i in range(args.runs):
            for name, stack in stacks.items():
                s = Subjects(stack.instance)
                r0 = procs[name]["rank 0"]
                for kind in ("selfbench+prefill", "http"):
                    before = gw.threads(r0)
                    cpu0 = {k: gw.cpu_s(p) for k, p in procs[name].items()}
                    coro = (
                        gw.selfbench(bus, s, args.batch, args.tp, prefill=True)
                        if kind != "http"
                        else g.via_http(stack.base_url, args.batch, stream=False)
                    )
                    tps, text, wall = await traced(coro, tmp / "perf.data")
                    busiest = sorted(
                        gw.threads(r0).items(),
                        key=lambda kv: -(kv[1][0] - before.get(kv[0], (0.0,))[0]),
                    )
                    compute = [t for t, _ in busiest[:2]]
                    a = analyse(text, compute, owners(procs[name], compute))
                    cpu = {k: round(gw.cpu_s(p) - cpu0[k], 2) for k, p in procs[name].items()}
                    row = {
                        "run": i,
                        "variant": name,
                        "kind": kind,
                        "load1": round(os.getloadavg()[0], 2),
                        "tokens_per_s": round(tps, 1),
                        "wall_s": round(wall, 2),
                        "cpu_s": cpu,
                        **a,
                    }
                    print(json.dumps(row), flush=True)
                    key = f"{name} {kind}"
                    res[f"{key} by_stack_s / wall"].append(a["by_stack_s"] / wall)
                    res[f"{key} other_on_cpu share"].append(
                        a["by_stack_other_on_cpu_s"] / a["by_stack_s"] if a["by_stack_s"] else 0
                    )
                    res[f"{key} foreign_s / wall"].append(
                        a["preempted_s"].get("foreign", 0.0) / wall
                    )
        gw.print_medians(res, 4)
    finally:
        await gw.stop_all(bus, stacks, server)


def main() -> None:
    ap = gw.arg_parser(tp=1)
    ap.add_argument(
        "--variants",
        default='{"default": {}}',
        help=f"JSON {{name: {{ENV: value}}}}; {gw.AUX_NICE}: its engine's and API's nice",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollbus-preempt-") as tmp:
        asyncio.run(main_async(args, Path(tmp)))


if __name__ == "__main__":
    main()
