"""Where an HTTP generation's time goes, against the in-process step loop (``selfbench``).

``python -m tests.bench.gen_where [--runs N] [--tp 2] [--batch 16]`` starts its own
nats-server and one stack serving the generation benchmark's model, then per run, A/B
interleaved: ``selfbench`` (decode steps only), ``selfbench`` with prefill (the same
work as HTTP: the prompts' prefill step plus the decode steps), and ``batch`` concurrent
``/v1/completions`` (64 tokens, greedy, ignore_eos). For each HTTP run it prints wall
time, the CPU seconds (user + sys, ``/proc/<pid>/stat``) of every process (api, engine,
each rank, nats-server, this client) and the engine's step timing (``/v1/status``
``step_time``: time in steps, rank 0's own compute, time between back-to-back steps;
steps and rows, so the first step's admission shows).

``--paths nats,http,raw`` runs each HTTP run's batch over other paths too, in the same
interleaving: ``nats`` the engine driven straight over the bus (the bench's "engine over
NATS" client), ``raw`` the same HTTP requests written by a minimal asyncio HTTP/1.1 client
(to tell httpx's own cost from the API's), ``stream`` SSE. Every run also prints a
timeline taken by a wildcard subscriber on the server: seconds from the client's start to
the first and last ``gen`` request on the bus and to the first ``worker.step``, the last
step sent, and the client's end; ``out_of_step_s`` = wall − the engine's ``in_step_s``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from services import natsd
from shared import messages as m
from shared.bus import Bus
from shared.subjects import Subjects
from tests.bench import generation as g
from tests.e2e.stack import start_stack

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def threads(pid: int) -> dict[int, tuple[float, float, int, int]]:
    """Per thread of a process: (CPU s, run-queue wait s, timeslices, involuntary
    switches), from ``/proc/<pid>/task/<tid>/schedstat`` and ``status``: whether the
    rank's compute threads are preempted more in a served run than in ``selfbench``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            run, wait, slices = (int(x) for x in (task / "schedstat").read_text().split())
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue
        nv = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[int(task.name)] = (run / 1e9, wait / 1e9, slices, nv)
    return out


def thread_delta(
    before: dict[int, tuple[float, float, int, int]], pid: int, top: int = 2
) -> list[dict[str, float]]:
    """The ``top`` busiest threads of ``pid`` since ``before``: cpu_s, wait_s (runnable,
    not running), slices, preempted (involuntary switches)."""
    rows = []
    for tid, (run, wait, slices, nv) in threads(pid).items():
        b = before.get(tid, (0.0, 0.0, 0, 0))
        rows.append(
            {
                "cpu_s": round(run - b[0], 2),
                "wait_s": round(wait - b[1], 3),
                "slices": slices - b[2],
                "preempted": nv - b[3],
            }
        )
    return sorted(rows, key=lambda r: -r["cpu_s"])[:top]


AUX_NICE = "BENCH_AUX_NICE"  # a variant's key: the nice of its engine and API (not ROLLBUS_)


def renice_aux(procs: dict[str, int], nice: int) -> None:
    """Lower the engine's and the API's priority to ``nice`` (the ranks keep theirs): does
    a lower priority for them make their wake-ups cost the ranks less? With autogroups on
    (``/proc/sys/kernel/sched_autogroup_enabled``) each process the launcher starts is a
    session, so a scheduling group, of its own, and only the group's nice counts against
    the ranks: both the group's and every thread's are set."""
    for name in ("engine", "api"):
        pid = procs[name]
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        for tid in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(tid.name), nice)


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def named(root: int, nats_pid: int) -> dict[str, int]:
    """The stack's processes by role (rank i from its environment)."""
    procs = {"nats-server": nats_pid, "client": os.getpid()}
    for pid in children(root):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        name = cmd[2].decode() if len(cmd) > 2 else str(pid)
        if name == "services.worker":
            name = f"rank {cmd[cmd.index(b'--rank') + 1].decode()}"
        procs[name.replace("services.", "")] = pid
    return procs


class Tap:
    """Times of the messages on the server (a wildcard subscriber): where a run's wall time
    goes before the first step and after the last."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str]] = []

    async def start(self, bus: Bus) -> None:
        async def on(msg: Any) -> None:
            self.events.append((time.perf_counter(), msg.subject))

        await bus.nc.subscribe(">", cb=on)

    def timeline(self, s: Subjects, t0: float, t1: float) -> dict[str, float | None]:
        def at(ts: list[float], i: int) -> float | None:
            return round(ts[i] - t0, 4) if ts else None

        ev = [(t, sub) for t, sub in self.events if t0 <= t <= t1]
        gens = [t for t, sub in ev if sub == s.gen]
        steps = [t for t, sub in ev if sub == s.worker_step]
        return {
            "first_gen_s": at(gens, 0),
            "last_gen_s": at(gens, -1),
            "first_step_s": at(steps, 0),
            "last_step_sent_s": at(steps, -1),
            "end_s": round(t1 - t0, 4),
        }


LAST: dict[str, float] = {}  # the last selfbench's step_ms and prefill_ms (rank 0)


async def selfbench(bus: Bus, s: Subjects, batch: int, tp: int, prefill: bool) -> float:
    args = m.SelfBenchArgs(batch=batch, steps=g.STEPS, prompt_len=g.PROMPT_LEN)
    if prefill:
        args.prefill = True
    reps = await bus.scatter(
        s.worker_ctl("selfbench"), m.json_encode(args), expected=tp, timeout=600
    )
    rep = m.json_decode(reps[0].data, type=m.WorkerReply)
    assert rep.error_code == 200, rep.error_message
    LAST.update({k: round(rep.result[k], 1) for k in ("step_ms", "prefill_ms")})
    return float(rep.result["tokens_per_s"])


def status(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/v1/status", timeout=60)
    r.raise_for_status()
    return dict(r.json())


async def http_run(
    base: str,
    procs: dict[str, int],
    batch: int,
    path: str = "http",
    bus: Bus | None = None,
    s: Subjects | None = None,
    tap: Tap | None = None,
) -> dict[str, Any]:
    before = {k: cpu_s(p) for k, p in procs.items()}
    rank0 = threads(procs["rank 0"])
    st0 = status(base)
    t0 = time.perf_counter()
    if path == "nats":
        assert bus is not None and s is not None
        tps = await g.via_bus(bus, s, batch)
    elif path == "raw":
        tps = await g.via_raw_http(base, batch)
    else:
        tps = await g.via_http(base, batch, stream=path == "stream")
    t1 = time.perf_counter()
    wall = t1 - t0
    await asyncio.sleep(0.05)  # the tap's last messages
    st1 = status(base)
    cpu = {k: round(cpu_s(p) - before[k], 2) for k, p in procs.items()}
    rank0_threads = thread_delta(rank0, procs["rank 0"])
    a, b = st0.get("step_time", {}), st1.get("step_time", {})
    steps = {k: round(b[k] - a[k], 3) for k in b}
    steps["steps"] = st1["steps"] - st0["steps"] - 0  # status calls step nothing
    out = {
        "tokens_per_s": round(tps, 1),
        "wall_s": round(wall, 2),
        "cpu_s": cpu,
        "rank0_threads": rank0_threads,
        "step": steps,
        "out_of_step_s": round(wall - steps.get("in_step_s", 0.0), 3),
    }
    if tap is not None and s is not None:
        out["timeline"] = tap.timeline(s, t0, t1)
    return out


async def main_async(args: argparse.Namespace, tmp: Path) -> None:
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.bench.hf_generate",
                "build",
                str(model_dir),
                json.dumps(g.MODEL),
            ],
            check=True,
        )
    variants: dict[str, dict[str, str]] = json.loads(args.variants)
    server = natsd.start(tmp / "nats", port=0)
    stacks = {}
    bus = await Bus.connect(server.url, "gen-where")
    tap = Tap()
    paths = args.paths.split(",")
    try:
        await tap.start(bus)
        procs = await start_variants(stacks, variants, tmp, server, model_dir, args)
        print("processes:", procs, flush=True)
        res: dict[str, list[float]] = {}
        for i in range(args.runs):
            for name, stack in stacks.items():
                s = Subjects(stack.instance)
                load = os.getloadavg()[0]
                rank0 = procs[name]["rank 0"]
                t = threads(rank0)
                sb = await selfbench(bus, s, args.batch, args.tp, prefill=False)
                sb_ms = dict(LAST)
                sb_threads = thread_delta(t, rank0)
                t = threads(rank0)
                sbp = (
                    await selfbench(bus, s, args.batch, args.tp, prefill=True)
                    if args.prefill
                    else float("nan")
                )
                sbp_threads = thread_delta(t, rank0) if args.prefill else []
                res.setdefault(f"{name} selfbench", []).append(sb)
                res.setdefault(f"{name} selfbench+prefill", []).append(sbp)
                for label, th in (("selfbench", sb_threads), ("selfbench+prefill", sbp_threads)):
                    if th:
                        res.setdefault(f"{name} {label} rank0 wait_s", []).append(
                            sum(r["wait_s"] for r in th)
                        )
                        res.setdefault(f"{name} {label} rank0 preempted", []).append(
                            sum(r["preempted"] for r in th)
                        )
                for path in paths:
                    h = await http_run(stack.base_url, procs[name], args.batch, path, bus, s, tap)
                    tap.events.clear()
                    res.setdefault(f"{name} {path}", []).append(h["tokens_per_s"])
                    res.setdefault(f"{name} {path} ratio", []).append(h["tokens_per_s"] / sb)
                    res.setdefault(f"{name} {path} out_of_step_s", []).append(h["out_of_step_s"])
                    th = h["rank0_threads"]
                    res.setdefault(f"{name} {path} rank0 wait_s", []).append(
                        sum(r["wait_s"] for r in th)
                    )
                    res.setdefault(f"{name} {path} rank0 preempted", []).append(
                        sum(r["preempted"] for r in th)
                    )
                    print(
                        json.dumps(
                            {
                                "run": i,
                                "variant": name,
                                "path": path,
                                "load1": round(load, 2),
                                "selfbench": round(sb, 1),
                                "selfbench_ms": sb_ms,
                                "selfbench_prefill": round(sbp, 1),
                                "selfbench_threads": sb_threads,
                                "selfbench_prefill_threads": sbp_threads,
                                **h,
                                "ratio": round(h["tokens_per_s"] / sb, 3),
                            }
                        ),
                        flush=True,
                    )
        print_medians(res, 3)
        if args.show_log:
            for stack in stacks.values():
                for line in stack.log.read_text(errors="replace").splitlines():
                    if args.show_log in line:
                        print(line)
    finally:
        await stop_all(bus, stacks, server)


async def start_variants(
    stacks: dict[str, Any],
    variants: dict[str, dict[str, str]],
    tmp: Path,
    server: Any,
    model_dir: Path,
    args: argparse.Namespace,
) -> dict[str, dict[str, int]]:
    """One stack per variant into ``stacks`` (the caller stops them), its processes by
    role (``AUX_NICE`` applied), each warmed up by one batch over HTTP."""
    for name, env in variants.items():
        stacks[name] = start_stack(
            tmp / name,
            server.url,
            tp=args.tp,
            model_dir=model_dir,
            model_name="bench",
            env={"ROLLBUS_KV_CACHE_BLOCKS": "1024", "ROLLBUS_CONTROL_TIMEOUT_S": "120", **env},
        )
    time.sleep(2)
    procs = {n: named(st.proc.pid, server.proc.pid) for n, st in stacks.items()}
    for name, env in variants.items():
        if AUX_NICE in env:
            renice_aux(procs[name], int(env[AUX_NICE]))
    for st in stacks.values():
        await g.via_http(st.base_url, args.batch, stream=False)  # warm up
    return procs


def print_medians(res: dict[str, list[float]], digits: int) -> None:
    for k, v in res.items():
        med, lo, hi = statistics.median(v), min(v), max(v)
        print(f"{k}: median {med:.{digits}f} (min {lo:.{digits}f} max {hi:.{digits}f})")


async def stop_all(bus: Any, stacks: dict[str, Any], server: Any) -> None:
    """The bench's client, then every stack, then the nats-server they share."""
    await bus.close()
    for stack in stacks.values():
        stack.stop()
    server.stop()


def arg_parser(tp: int) -> argparse.ArgumentParser:
    """The options every stack-per-variant tool here shares (runs, tp, batch, model dir)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=tp)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--model-dir", default="/tmp/rollbus-gen-where/bench")
    return ap


def main() -> None:
    ap = arg_parser(tp=2)
    ap.add_argument("--prefill", action="store_true", help="also selfbench with prefill")
    ap.add_argument(
        "--paths",
        default="http",
        help="comma-separated, per run in this order: http (httpx, the bench's "
        "client), raw (a minimal HTTP/1.1 client), stream (SSE), nats (the engine "
        "over the bus, no API)",
    )
    ap.add_argument(
        "--variants",
        default='{"default": {}}',
        help="JSON {name: {ENV: value}}: one stack each, runs interleaved; "
        f"{AUX_NICE}: the nice of that stack's engine and API",
    )
    ap.add_argument("--show-log", default="", help="print the stack's log lines with this")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollbus-gen-where-") as tmp:
        asyncio.run(main_async(args, Path(tmp)))


if __name__ == "__main__":
    main()
