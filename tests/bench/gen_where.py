"""Where an HTTP generation's time goes, against the in-process step loop (``selfbench``).

``python -m tests.bench.gen_where [--runs N] [--tp 2] [--batch 16]`` starts its own
nats-server and one stack serving the generation benchmark's model, then per run, A/B
interleaved: ``selfbench`` (decode steps only), ``selfbench`` with prefill (the same
work as HTTP: the prompts' prefill step plus the decode steps), and ``batch`` concurrent
``/v1/completions`` (64 tokens, greedy, ignore_eos). For each HTTP run it prints wall
time, the CPU seconds (user + sys, ``/proc/<pid>/stat``) of every process (api, engine,
each rank, nats-server, this client) and the engine's step timing (``/v1/status``
``step_time``: time in steps, rank 0's own compute, time between back-to-back steps;
steps and rows, so the first step's admission shows)."""

from __future__ import annotations

import argparse
import asyncio
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


LAST: dict[str, float] = {}  # the last selfbench's step_ms and prefill_ms (rank 0)


async def selfbench(bus: Bus, s: Subjects, batch: int, tp: int, prefill: bool) -> float:
    args = m.SelfBenchArgs(batch=batch, steps=g.STEPS, prompt_len=g.PROMPT_LEN)
    if prefill:
        args.prefill = True
    reps = await bus.scatter(s.worker_ctl("selfbench"), m.json_encode(args), expected=tp,
                             timeout=600)
    rep = m.json_decode(reps[0].data, type=m.WorkerReply)
    assert rep.error_code == 200, rep.error_message
    LAST.update({k: round(rep.result[k], 1) for k in ("step_ms", "prefill_ms")})
    return float(rep.result["tokens_per_s"])


def status(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/v1/status", timeout=60)
    r.raise_for_status()
    return dict(r.json())


async def http_run(base: str, procs: dict[str, int], batch: int) -> dict[str, Any]:
    before = {k: cpu_s(p) for k, p in procs.items()}
    st0 = status(base)
    t0 = time.perf_counter()
    tps = await g.via_http(base, batch, stream=False)
    wall = time.perf_counter() - t0
    st1 = status(base)
    cpu = {k: round(cpu_s(p) - before[k], 2) for k, p in procs.items()}
    a, b = st0.get("step_time", {}), st1.get("step_time", {})
    steps = {k: round(b[k] - a[k], 3) for k in b}
    steps["steps"] = st1["steps"] - st0["steps"] - 0  # status calls step nothing
    return {"tokens_per_s": round(tps, 1), "wall_s": round(wall, 2), "cpu_s": cpu,
            "step": steps}


async def main_async(args: argparse.Namespace, tmp: Path) -> None:
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tests.bench.hf_generate", "build",
                        str(model_dir), json.dumps(g.MODEL)], check=True)
    variants: dict[str, dict[str, str]] = json.loads(args.variants)
    server = natsd.start(tmp / "nats", port=0)
    stacks = {}
    bus = await Bus.connect(server.url, "gen-where")
    try:
        for name, env in variants.items():
            stacks[name] = start_stack(
                tmp / name, server.url, tp=args.tp, model_dir=model_dir, model_name="bench",
                env={"ROLLBUS_KV_CACHE_BLOCKS": "1024", "ROLLBUS_CONTROL_TIMEOUT_S": "120",
                     **env})
        time.sleep(2)
        procs = {n: named(st.proc.pid, server.proc.pid) for n, st in stacks.items()}
        print("processes:", procs, flush=True)
        for st in stacks.values():
            await g.via_http(st.base_url, args.batch, stream=False)  # warm up
        res: dict[str, list[float]] = {}
        for i in range(args.runs):
            for name, stack in stacks.items():
                s = Subjects(stack.instance)
                load = os.getloadavg()[0]
                sb = await selfbench(bus, s, args.batch, args.tp, prefill=False)
                sb_ms = dict(LAST)
                sbp = await selfbench(bus, s, args.batch, args.tp, prefill=True) \
                    if args.prefill else float("nan")
                h = await http_run(stack.base_url, procs[name], args.batch)
                res.setdefault(f"{name} selfbench", []).append(sb)
                res.setdefault(f"{name} selfbench+prefill", []).append(sbp)
                res.setdefault(f"{name} http", []).append(h["tokens_per_s"])
                res.setdefault(f"{name} ratio", []).append(h["tokens_per_s"] / sb)
                print(json.dumps({"run": i, "variant": name, "load1": round(load, 2),
                                  "selfbench": round(sb, 1), "selfbench_ms": sb_ms,
                                  "selfbench_prefill": round(sbp, 1),
                                  **h, "ratio": round(h["tokens_per_s"] / sb, 3)}), flush=True)
        for k, v in res.items():
            print(f"{k}: median {statistics.median(v):.3f} (min {min(v):.3f} max {max(v):.3f})")
        if args.show_log:
            for stack in stacks.values():
                for line in stack.log.read_text(errors="replace").splitlines():
                    if args.show_log in line:
                        print(line)
    finally:
        await bus.close()
        for stack in stacks.values():
            stack.stop()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill", action="store_true", help="also selfbench with prefill")
    ap.add_argument("--variants", default='{"default": {}}',
                    help='JSON {name: {ENV: value}}: one stack each, runs interleaved')
    ap.add_argument("--show-log", default="", help="print the stack's log lines with this")
    ap.add_argument("--model-dir", default="/tmp/rollbus-gen-where/bench")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollbus-gen-where-") as tmp:
        asyncio.run(main_async(args, Path(tmp)))


if __name__ == "__main__":
    main()
