"""CPU the API and engine processes spend per generated token (issue 9 item 7).

``python -m tests.bench.api_cpu [--code DIR ...] [--rounds N] [--tp 1] [--profile OUT]``

Starts one stack (TP=1 by default) per ``--code`` checkout (default: this one; e.g.
``--code /work/main --code .`` compares main with a branch), each serving the same tiny
model, and runs the bench workload on them in turn, interleaved round by round: 16
concurrent requests of 16-token prompts and 64 new tokens (greedy, ``ignore_eos``),
non-streamed and streamed ``/v1/completions``, and the engine driven directly over NATS
(no API). For each it reads the CPU time (user + system, ``/proc/<pid>/stat``) the API
and the engine processes used and prints it per 1024 generated tokens: robust on a busy
machine, where wall-clock throughput is not (on shared cores what the API and the engine
spend per token is taken from the ranks' compute). ``--profile OUT`` also runs the API
and the engine of the last ``--code`` under cProfile (stats in ``OUT.api`` and
``OUT.engine`` when the stack stops)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
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
for _role in ("api", "engine"):
    if b"services." + _role.encode() in _cmd:
        _p = cProfile.Profile()
        _p.enable()
        atexit.register(lambda: (_p.disable(), _p.dump_stats({out!r} + "." + _role)))
        break
"""


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> dict[str, int]:
    """The launcher's ``api`` and ``engine`` child processes: role -> pid."""
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
    return out


class Served:
    def __init__(self, code: Path, tmp: Path, nats_url: str, model: Path, tp: int,
                 profile: Path | None, extra: str = "") -> None:
        self.code = f"{code} + {extra}" if extra else str(code)
        tmp.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.instance = f"c{uuid.uuid4().hex[:8]}"
        env = serve_env(
            ROLLBUS_INSTANCE=self.instance, ROLLBUS_API_PORT=str(port),
            ROLLBUS_MODEL=str(model), ROLLBUS_DATA_DIR=str(tmp / "data"), ROLLBUS_TP=str(tp),
            ROLLBUS_NATS_URL=nats_url, ROLLBUS_KV_CACHE_BLOCKS="512",
            ROLLBUS_CONTROL_TIMEOUT_S="60", ROLLBUS_LOG_LEVEL="warning",
        )
        env["PYTHONPATH"] = str(code) + (os.pathsep + extra if extra else "")
        if profile is not None:  # a sitecustomize that profiles the API process only
            hook = tmp / "profhook"
            hook.mkdir(parents=True, exist_ok=True)
            (hook / "sitecustomize.py").write_text(PROFILE_HOOK.format(out=str(profile)))
            env["PYTHONPATH"] += os.pathsep + str(hook)
        self.log = tmp / "serve.log"
        self.base = f"http://127.0.0.1:{port}"
        self.proc = spawn(env, self.log, cwd=code)
        wait_healthy(self.base, self.proc, self.log)
        self.pids = children(self.proc.pid)

    def cpu(self) -> dict[str, float]:
        return {role: cpu_seconds(pid) for role, pid in self.pids.items()}

    def steps(self) -> int:
        return int(httpx.get(self.base + "/v1/status", timeout=30).json()["steps"])


def _prompt(i: int) -> list[int]:
    return [256] + [(7 * i + j) % 250 for j in range(PROMPT_LEN - 1)]


REPEAT = 4  # batches per measurement (CPU time is counted in clock ticks of 10 ms)


async def http_batch(c: httpx.AsyncClient, stream: bool) -> int:
    async def one(i: int) -> int:
        body = {"prompt": _prompt(i), "max_tokens": STEPS, "temperature": 0,
                "ignore_eos": True, "stream": stream}
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
        n, gen = 0, m.GenRequest(uuid.uuid4().hex, _prompt(i), STEPS, temperature=0.0,
                                 stop_token_ids=[])
        async for rep in bus.stream(s.gen, m.pack(gen), idle_timeout=120,
                                    request_id=gen.request_id):
            c = m.unpack(rep.data, type=m.GenChunk)
            n += len(c.token_ids)
            if c.finish_reason:
                break
        return n

    return sum(await asyncio.gather(*(one(i) for i in range(BATCH))))


async def measure(stacks: list[Served], rounds: int, nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "bench-api-cpu")
    modes = ("non-stream", "stream", "engine direct")
    # (code, mode) -> per round: (api ms / 1024 tok, engine ms / 1024 tok, tok/s, steps)
    res: dict[tuple[int, str], list[tuple[float, float, float, float]]] = {}
    try:
        clients = [httpx.AsyncClient(base_url=st.base, timeout=600) for st in stacks]
        for c in clients:
            await http_batch(c, False)  # warm up
        for r in range(rounds + 1):
            for k, (st, c) in enumerate(zip(stacks, clients, strict=True)):
                for mode in modes:
                    steps0, before, t0 = st.steps(), st.cpu(), time.perf_counter()
                    toks = 0
                    for _ in range(REPEAT):
                        if mode == "engine direct":
                            toks += await bus_batch(bus, Subjects(st.instance))
                        else:
                            toks += await http_batch(c, mode == "stream")
                    wall, after = time.perf_counter() - t0, st.cpu()
                    steps = (st.steps() - steps0) / REPEAT
                    if r == 0:
                        continue  # warm-up round
                    per = {k2: (after[k2] - before[k2]) * 1e3 * 1024 / toks for k2 in after}
                    res.setdefault((k, mode), []).append(
                        (per.get("api", 0.0), per.get("engine", 0.0), toks / wall, steps))
        for c in clients:
            await c.aclose()
    finally:
        await bus.close()
    print(f"\nCPU ms per 1024 generated tokens (median of {rounds} rounds of {REPEAT} batches "
          f"of {BATCH} requests, {STEPS} new tokens each)\n")
    print("| code | path | API cpu ms | engine cpu ms | tokens/s (noisy) | steps per batch |")
    print("|---|---|---|---|---|---|")
    for k, st in enumerate(stacks):
        for mode in modes:
            rows = res[(k, mode)]
            api, eng, tps, steps = (statistics.median(x[i] for x in rows) for i in range(4))
            print(f"| {st.code} | {mode} | {api:.0f} | {eng:.0f} | {tps:.0f} | {steps:.1f} |")


def main() -> None:
    global REPEAT
    ap = argparse.ArgumentParser(prog="api_cpu")
    ap.add_argument("--code", type=Path, action="append", default=[])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None,
                    help="serve this model dir (default: a tiny one made here), e.g. the "
                    "bench's (`python -m tests.bench.hf_generate build DIR JSON`)")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="batches per measurement")
    ap.add_argument("--extra-path", default="",
                    help="also run the last --code with this appended to its PYTHONPATH "
                    "(e.g. a --target dir with uvloop / httptools, which uvicorn then uses)")
    args = ap.parse_args()
    REPEAT = args.repeat
    codes = [c.resolve() for c in args.code] or [Path.cwd()]
    tmp = Path(tempfile.mkdtemp(prefix="rollbus-apicpu-"))
    server = natsd.start(tmp / "nats", port=0)
    model = args.model or create_model_dir(tmp / "models" / "tiny", None, seed=0)
    stacks: list[Served] = []
    try:
        for i, code in enumerate(codes):
            prof = args.profile if args.profile and i == len(codes) - 1 else None
            stacks.append(Served(code, tmp / f"s{i}", server.url, model, args.tp, prof))
        if args.extra_path:
            stacks.append(Served(codes[-1], tmp / "extra", server.url, model, args.tp, None,
                                 args.extra_path))
        asyncio.run(measure(stacks, args.rounds, server.url))
    finally:
        for st in stacks:
            stop(st.proc)
        server.stop()


if __name__ == "__main__":
    main()
