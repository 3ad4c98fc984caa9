"""CPU the stack's processes spend per generated token beside the ranks' compute (issue 9
item 7).

``python -m tests.bench.api_cpu [--code DIR ...] [--rounds N] [--tp 1] [--profile OUT]
[--modes non-stream,stream,engine]``

Starts one stack (TP=1 by default) per ``--code`` checkout (default: this one; e.g.
``--code /work/main --code .`` compares main with a branch), each on its own
nats-server and serving the same model (a tiny one unless ``--model``), and runs the
bench workload on them in turn, interleaved round by round: 16 concurrent requests of
16-token prompts and 64 new tokens (greedy, ``ignore_eos``), non-streamed and streamed
``/v1/completions``, and the engine driven directly over NATS (no API). For each it
reads the CPU time (user + system) of the API, the engine, the stack's nats-server, and
rank 0's threads other than its two busiest (its event loop and the like: at TP=1 the
two busiest are paddle's compute thread and its OpenMP worker, and every CPU-second the
others take on a 2-core host comes out of them), and prints it per 1024 generated
tokens, median and min–max over the rounds: robust on a busy machine, where wall-clock
throughput is not. What a stack spends while idle (status refresh, heartbeats, probes)
goes with wall time, which on a loaded host varies from run to run: each round first
measures each stack's idle rate (``--idle`` seconds; rank 0's per thread, split as the
run's busiest two) and a run's CPU above it is what is reported. ``--profile OUT`` also
runs the API, the engine and the ranks of the last ``--code`` under cProfile (their main
thread: a rank's event loop; CPU time; stats in
``OUT.api``, ``OUT.engine``, ``OUT.worker<pid>`` when the stack stops)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx

from services import natsd
from services.serveproc import free_port, serve_env, spawn, stop, wait_healthy
from services.tiny_model import create_model_dir
from shared import messages as m
from shared.bus import Bus
from shared.subjects import Subjects

BATCH, PROMPT_LEN, STEPS = 16, 16, 64
TICK = os.sysconf("SC_CLK_TCK")
PROFILE_HOOK = """
import atexit, cProfile, pathlib
_cmd = pathlib.Path("/proc/self/cmdline").read_bytes().split(b"\\0")
for _role in ("api", "engine", "worker"):
    if b"services." + _role.encode() in _cmd:
        _p = cProfile.Profile(__import__("time").thread_time)  # CPU, not wall
        _p.enable()
        _name = _role + (str(__import__("os").getpid()) if _role == "worker" else "")
        _dump = lambda: (_p.disable(), _p.dump_stats({out!r} + "." + _name))
        atexit.register(_dump)
        _exit = __import__("os")._exit  # a rank leaves by os._exit: no atexit
        __import__("os")._exit = lambda code: (_dump(), _exit(code))
        break
"""


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` (``schedstat``: nanoseconds, finer than the
    10 ms ticks of ``stat``)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread ended
    return out


def busiest(before: dict[int, float], after: dict[int, float], n: int = 2) -> set[int]:
    """The ``n`` threads that used the most CPU between two ``thread_seconds``: at TP=1
    rank 0's compute thread and its OpenMP worker during a run."""
    used = sorted(after, key=lambda t: after[t] - before.get(t, 0.0), reverse=True)
    return set(used[:n])


def children(pid: int) -> dict[str, int]:
    """The launcher's ``api``, ``engine`` and rank 0 (``rank0``) processes: role -> pid."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for role in ("api", "engine"):
            if f"services.{role}".encode() in cmd:
                out[role] = int(p)
        if b"services.worker" in cmd and cmd[cmd.index(b"--rank") + 1] == b"0":
            out["rank0"] = int(p)
    return out


# what is reported per process, in this order
COLUMNS = ("api", "engine", "rank0 other", "nats", "rank0 compute")


class Served:
    def __init__(
        self,
        code: Path,
        tmp: Path,
        nats_url: str | None,
        model: Path,
        tp: int,
        profile: Path | None,
        extra: str = "",
    ) -> None:
        """One stack of ``code``; on ``nats_url``, or on a nats-server of its own (None:
        its CPU is then this stack's alone)."""
        self.code = f"{code} + {extra}" if extra else str(code)
        tmp.mkdir(parents=True, exist_ok=True)
        self.server: natsd.NatsServer | None = None
        if nats_url is None:
            self.server = natsd.start(tmp / "nats", port=0)
            nats_url = self.server.url
        self.nats_url = nats_url
        port = free_port()
        self.instance = f"c{uuid.uuid4().hex[:8]}"
        env = serve_env(
            ROLLBUS_INSTANCE=self.instance,
            ROLLBUS_API_PORT=str(port),
            ROLLBUS_MODEL=str(model),
            ROLLBUS_DATA_DIR=str(tmp / "data"),
            ROLLBUS_TP=str(tp),
            ROLLBUS_NATS_URL=self.nats_url,
            ROLLBUS_KV_CACHE_BLOCKS="512",
            ROLLBUS_CONTROL_TIMEOUT_S="60",
            ROLLBUS_LOG_LEVEL="warning",
        )
        env["PYTHONPATH"] = str(code) + (os.pathsep + extra if extra else "")
        if profile is not None:  # a sitecustomize that profiles the stack's processes
            hook = tmp / "profhook"
            hook.mkdir(parents=True, exist_ok=True)
            (hook / "sitecustomize.py").write_text(PROFILE_HOOK.format(out=str(profile)))
            env["PYTHONPATH"] += os.pathsep + str(hook)
        self.log = tmp / "serve.log"
        self.base = f"http://127.0.0.1:{port}"
        self.proc = spawn(env, self.log, cwd=code)
        wait_healthy(self.base, self.proc, self.log)
        self.pids = children(self.proc.pid)

    def cpu(self) -> tuple[dict[str, float], dict[int, float]]:
        """CPU seconds of the API, the engine and nats-server; rank 0's per thread."""
        procs = {k: v for k, v in self.pids.items() if k != "rank0"}
        if self.server is not None:
            procs["nats"] = self.server.proc.pid
        return {role: cpu_seconds(pid) for role, pid in procs.items()}, thread_seconds(
            self.pids["rank0"]
        )

    def steps(self) -> int:
        return int(httpx.get(self.base + "/v1/status", timeout=30).json()["steps"])

    def stop(self) -> None:
        stop(self.proc)
        if self.server is not None:
            self.server.stop()


def _prompt(i: int) -> list[int]:
    return [256] + [(7 * i + j) % 250 for j in range(PROMPT_LEN - 1)]


REPEAT = 4  # batches per measurement (CPU time is counted in clock ticks of 10 ms)
MODES = ("non-stream", "stream", "engine")


async def http_batch(c: httpx.AsyncClient, stream: bool) -> int:
    async def one(i: int) -> int:
        body = {
            "prompt": _prompt(i),
            "max_tokens": STEPS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        if not stream:
            r = await c.post("/v1/completions", json=body)
            return int(r.json()["usage"]["completion_tokens"])
        n = 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
        return n

    return sum(await asyncio.gather(*(one(i) for i in range(BATCH))))


async def bus_batch(bus: Bus, s: Subjects) -> int:
    async def one(i: int) -> int:
        n, gen = (
            0,
            m.GenRequest(uuid.uuid4().hex, _prompt(i), STEPS, temperature=0.0, stop_token_ids=[]),
        )
        async for rep in bus.stream(
            s.gen, m.pack(gen), idle_timeout=120, request_id=gen.request_id
        ):
            c = m.unpack(rep.data, type=m.GenChunk)
            n += len(c.token_ids)
            if c.finish_reason:
                break
        return n

    return sum(await asyncio.gather(*(one(i) for i in range(BATCH))))


def _spread(xs: Sequence[float]) -> str:
    return f"{statistics.median(xs):.0f} ({min(xs):.0f}–{max(xs):.0f})"


Reading = tuple[dict[str, float], dict[int, float]]  # Served.cpu()


def _used(a: Reading, b: Reading, compute: set[int]) -> dict[str, float]:
    """CPU seconds per column between two :meth:`Served.cpu` readings; rank 0's threads
    ``compute`` and the others apart."""
    used = {k: b[0][k] - a[0][k] for k in b[0]}
    threads = {t: v - a[1].get(t, 0.0) for t, v in b[1].items()}
    used["rank0 compute"] = sum(v for t, v in threads.items() if t in compute)
    used["rank0 other"] = sum(v for t, v in threads.items() if t not in compute)
    return used


async def idle_rates(st: Served, seconds: float) -> tuple[dict[str, float], dict[int, float]]:
    """CPU seconds per second each process, and each thread of rank 0, uses while the
    stack is idle (the rank status refresh, the engine's heartbeats and probes,
    nats-server's pings)."""
    before, t0 = st.cpu(), time.perf_counter()
    await asyncio.sleep(seconds)
    after, wall = st.cpu(), time.perf_counter() - t0
    procs = {k: (v - before[0][k]) / wall for k, v in after[0].items()}
    return procs, {t: (v - before[1].get(t, 0.0)) / wall for t, v in after[1].items()}


async def measure(stacks: list[Served], rounds: int, modes: Sequence[str], idle_s: float) -> None:
    buses = [await Bus.connect(st.nats_url, "bench-api-cpu") for st in stacks]
    # (code, mode) -> per round: {column: ms / 1024 tok, "tok/s": ..., "steps": ...}
    res: dict[tuple[int, str], list[dict[str, float]]] = {}
    idle: dict[int, list[dict[str, float]]] = {}
    try:
        clients = [httpx.AsyncClient(base_url=st.base, timeout=600) for st in stacks]
        for c in clients:
            await http_batch(c, False)  # warm up
        for r in range(rounds + 1):
            for k, (st, c, bus) in enumerate(zip(stacks, clients, buses, strict=True)):
                # the stack's idle rate, this round: a run's CPU above it is what serving
                # costs (on a loaded host a run's wall, so its idle work, varies a lot)
                rate = await idle_rates(st, idle_s) if idle_s > 0 else ({}, {})
                for mode in modes:
                    steps0, before, t0 = st.steps(), st.cpu(), time.perf_counter()
                    toks = 0
                    for _ in range(REPEAT):
                        if mode == "engine":
                            toks += await bus_batch(bus, Subjects(st.instance))
                        else:
                            toks += await http_batch(c, mode == "stream")
                    wall, after = time.perf_counter() - t0, st.cpu()
                    compute = busiest(before[1], after[1])
                    used = _used(before, after, compute)
                    # the idle rate of the same columns: rank 0's threads split as here
                    idle_rate = {**rate[0]}
                    idle_rate["rank0 compute"] = sum(v for t, v in rate[1].items() if t in compute)
                    idle_rate["rank0 other"] = sum(
                        v for t, v in rate[1].items() if t not in compute
                    )
                    steps = (st.steps() - steps0) / REPEAT
                    if r == 0:
                        continue  # warm-up round
                    row = {
                        k2: (v - idle_rate.get(k2, 0.0) * wall) * 1e3 * 1024 / toks
                        for k2, v in used.items()
                    }
                    row["tok/s"], row["steps"] = toks / wall, steps
                    res.setdefault((k, mode), []).append(row)
                    print(
                        f"round {r} {st.code} {mode}: "
                        + ", ".join(f"{k2} {v:.0f}" for k2, v in row.items()),
                        flush=True,
                    )
                    if r:
                        idle.setdefault(k, []).append(idle_rate)
        for c in clients:
            await c.aclose()
    finally:
        for bus in buses:
            await bus.close()
    above = f"above the stack's idle rate (measured {idle_s:g} s before each run)"
    print(
        f"\nCPU ms per 1024 generated tokens{' ' + above if idle_s > 0 else ''}: median "
        f"(min–max) of {rounds} rounds of {REPEAT} batches of {BATCH} requests, {STEPS} new "
        "tokens each; rank0 other = rank 0's threads but its two busiest\n"
    )
    print("| code | path | " + " | ".join(COLUMNS) + " | tokens/s (noisy) | steps/batch |")
    print("|---|---|" + "---|" * (len(COLUMNS) + 2))
    for k, st in enumerate(stacks):
        for mode in modes:
            rows = res[(k, mode)]
            cells = [_spread([x.get(col, 0.0) for x in rows]) for col in COLUMNS]
            tps = statistics.median(x["tok/s"] for x in rows)
            steps = statistics.median(x["steps"] for x in rows)
            print(f"| {st.code} | {mode} | " + " | ".join(cells) + f" | {tps:.0f} | {steps:.1f} |")
    if idle:
        print("\nidle CPU ms per second (median, min–max)\n")
        print("| code | " + " | ".join(COLUMNS) + " |")
        print("|---|" + "---|" * len(COLUMNS))
        for k, st in enumerate(stacks):
            cells = [_spread([x.get(col, 0.0) * 1e3 for x in idle[k]]) for col in COLUMNS]
            print(f"| {st.code} | " + " | ".join(cells) + " |")


def main() -> None:
    global REPEAT
    ap = argparse.ArgumentParser(prog="api_cpu")
    ap.add_argument("--code", type=Path, action="append", default=[])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="serve this model dir (default: a tiny one made here), e.g. the "
        "bench's (`python -m tests.bench.hf_generate build DIR JSON`)",
    )
    ap.add_argument("--repeat", type=int, default=REPEAT, help="batches per measurement")
    ap.add_argument(
        "--idle",
        type=float,
        default=5.0,
        help="seconds of each stack's idle CPU measured before each round; what a run "
        "uses above that rate is reported (0: gross CPU)",
    )
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, of {','.join(MODES)} (engine: over NATS, no API)",
    )
    ap.add_argument(
        "--extra-path",
        default="",
        help="also run the last --code with this appended to its PYTHONPATH "
        "(e.g. a --target dir with uvloop / httptools, which uvicorn then uses)",
    )
    args = ap.parse_args()
    REPEAT = args.repeat
    modes = [x for x in args.modes.split(",") if x]
    if bad := [x for x in modes if x not in MODES]:
        ap.error(f"--modes: unknown {bad}")
    codes = [c.resolve() for c in args.code] or [Path.cwd()]
    tmp = Path(tempfile.mkdtemp(prefix="rollbus-apicpu-"))
    model = args.model or create_model_dir(tmp / "models" / "tiny", None, seed=0)
    stacks: list[Served] = []
    try:
        for i, code in enumerate(codes):
            prof = args.profile if args.profile and i == len(codes) - 1 else None
            stacks.append(Served(code, tmp / f"s{i}", None, model, args.tp, prof))
        if args.extra_path:
            stacks.append(
                Served(codes[-1], tmp / "extra", None, model, args.tp, None, args.extra_path)
            )
        asyncio.run(measure(stacks, args.rounds, modes, args.idle))
    finally:
        for st in stacks:
            st.stop()


if __name__ == "__main__":
    main()
