"""``GET /v1/is_paused`` of two checkouts in the same run, each against the bare route
(:mod:`tests.bench.bare_http`) served by that checkout's own server config.

``python -m tests.bench.http_ab --code BEFORE --code AFTER [--plain CODE] [--extra-path DEPS]
[--tp 2] [--calls 200] [--runs 5]``

Starts one stack per ``--code`` and one raw responder. ``--extra-path`` is appended to the
PYTHONPATH of the last one and of its bare route (e.g. a ``pip install --target`` dir with
uvloop and httptools); a checkout also given as ``--plain`` runs, bare route included,
with uvloop and httptools hidden (their import fails: uvicorn's asyncio and h11, as a
checkout from before they were adopted ran where they were not installed). Then, run
after run, it calls the four servers in turn (bare A, rollbus A, bare B, rollbus B)
``calls`` times each, sequentially. Prints the p50 latency and the server process's CPU
time per call (every thread's ``/proc/<pid>/task/*/schedstat``, in ns — ``/proc/<pid>/stat``
counts 10 ms clock ticks, 50 µs steps over 200 calls: robust on a busy host, where
latency is not),
median (min–max) over runs, and each rollbus / its bare route ratio per run."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from services import natsd
from services.serveproc import stop
from services.tiny_model import create_model_dir
from tests.bench.api_cpu import Served
from tests.bench.control_plane import _ready, _spawn, _wait_http
from tests.e2e.stack import free_port


def cpu_seconds(pid: int) -> float:
    """CPU time the process ``pid`` ran so far, all its threads (the scheduler's ns
    count; a thread that ended meanwhile is not counted)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):
            continue  # the thread ended
    return total / 1e9


def _mm(xs: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


async def _measure(targets: list[tuple[str, str, int]], calls: int, runs: int) -> None:
    for _, url, _ in targets:
        await _wait_http(url)
    lat: dict[str, list[float]] = {n: [] for n, _, _ in targets}
    cpu: dict[str, list[float]] = {n: [] for n, _, _ in targets}
    clients = [httpx.AsyncClient(timeout=30) for _ in targets]
    try:
        for r in range(runs + 1):  # run 0 warms up
            for (name, url, pid), c in zip(targets, clients, strict=True):
                xs = []
                c0 = cpu_seconds(pid)
                for _ in range(calls):
                    t0 = time.perf_counter()
                    (await c.get(url)).raise_for_status()
                    xs.append(time.perf_counter() - t0)
                if r:
                    lat[name].append(statistics.median(xs) * 1e3)
                    cpu[name].append((cpu_seconds(pid) - c0) / calls * 1e6)
    finally:
        for c in clients:
            await c.aclose()
    print(f"\n{runs} runs of {calls} sequential GETs; load average {os.getloadavg()[0]:.1f}\n")
    print("| server | p50 ms, median (min–max) | server process CPU µs per call |")
    print("|---|---|---|")
    for name, _, _ in targets:
        print(f"| {name} | {_mm(lat[name])} | {_mm(cpu[name], '{:.0f}')} |")
    for i in range(0, len(targets), 2):
        bare, ours = targets[i][0], targets[i + 1][0]
        ratios = [o / b for o, b in zip(lat[ours], lat[bare], strict=True)]
        print(f"\n{ours} / {bare}: {_mm(ratios, '{:.2f}')}×")


def main() -> None:
    ap = argparse.ArgumentParser(prog="http_ab")
    ap.add_argument("--code", type=Path, action="append", default=[])
    ap.add_argument("--extra-path", default="", help="appended to the last --code's path")
    ap.add_argument(
        "--plain",
        type=Path,
        action="append",
        default=[],
        help="serve this --code with uvloop and httptools hidden",
    )
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    codes = [c.resolve() for c in args.code] or [Path.cwd()]
    plain = {c.resolve() for c in args.plain}
    tmp = Path(tempfile.mkdtemp(prefix="rollbus-httpab-"))
    hide = tmp / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nsys.modules['uvloop'] = None\nsys.modules['httptools'] = None\n"
    )
    server = natsd.start(tmp / "nats", port=0)
    subject = f"bench.req.{uuid.uuid4().hex[:8]}"
    procs = [_spawn("tests.bench.responder", server.url, subject, "1")]
    stacks: list[Served] = []
    try:
        _ready(procs[0])
        model = create_model_dir(tmp / "models" / "tiny", None, seed=0)
        targets: list[tuple[str, str, int]] = []
        for i, code in enumerate(codes):
            extra = args.extra_path if i == len(codes) - 1 else ""
            if code in plain:
                extra = os.pathsep.join(x for x in (extra, str(hide)) if x)
            path = str(code) + (os.pathsep + extra if extra else "")
            port = free_port()
            bare = subprocess.Popen(
                [sys.executable, "-m", "tests.bench.bare_http", server.url, subject, str(port)],
                cwd=code,
                env={**os.environ, "PYTHONPATH": path},
            )
            procs.append(bare)
            st = Served(code, tmp / f"s{i}", server.url, model, args.tp, None, extra)
            stacks.append(st)
            targets.append((f"bare route ({st.code})", f"http://127.0.0.1:{port}/bare", bare.pid))
            targets.append((f"rollbus ({st.code})", st.base + "/v1/is_paused", st.pids["api"]))
        asyncio.run(_measure(targets, args.calls, args.runs))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        for st in stacks:
            stop(st.proc)
        server.stop()


if __name__ == "__main__":
    main()
