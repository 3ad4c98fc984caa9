"""Soak: thousands of mixed control calls with random jitter, over NATS and HTTP, while
generation streams run; checks that no reply is lost or crossed, no call hangs, the
pending-reply maps of engine and API are back to 0, and prints every process's RSS
before and after.

``python -m tests.bench soak --soak-calls 10000 --soak-streams 16``; the short version
runs in ``just test`` (tests/e2e/test_soak.py) with the same checks.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shared.bus import Bus
from shared.errors import ControlError
from shared.subjects import Subjects
from tests.bench.common import pct, start_stack_retry
from tests.e2e.stack import Stack

# method, HTTP route, query, weight
MIX: list[tuple[str, str, dict[str, str], int]] = [
    ("is_paused", "GET /v1/is_paused", {}, 20),
    ("status", "GET /v1/status", {}, 8),
    ("pause", "POST /v1/pause", {"mode": "keep"}, 8),
    ("pause", "POST /v1/pause", {"mode": "abort"}, 5),
    ("pause", "POST /v1/pause", {"mode": "wait"}, 5),
    ("resume", "POST /v1/resume", {}, 26),
    ("sleep", "POST /v1/sleep", {"tags": "kv_cache"}, 4),
    ("wakeup", "POST /v1/wakeup", {"tags": "kv_cache"}, 8),
    ("update_weights", "POST /v1/update_weights", {}, 6),
]
CALL_BOUND_S = 30.0  # a call that takes longer is "hung"
STREAM_BOUND_S = 120.0


@dataclass
class SoakResult:
    calls: int = 0
    streams: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    by_method: defaultdict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    ok_ms: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    conflicts: Counter[str] = field(default_factory=Counter)  # 409s by method and reason
    latency: dict[str, list[float]] = field(default_factory=lambda: {"nats": [], "http": []})
    lost: int = 0  # no reply from the engine (a timeout answer)
    crossed: int = 0  # a reply carrying another call's request id
    hung: int = 0  # a call (or stream) not answered within its bound
    unexpected: list[str] = field(default_factory=list)
    stream_ends: Counter[str] = field(default_factory=Counter)
    pending: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    rss_before: dict[str, int] = field(default_factory=dict)
    rss_after: dict[str, int] = field(default_factory=dict)
    rss_trend: defaultdict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    seconds: float = 0.0


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def processes(stack: Stack, status: dict[str, Any], nats_pid: int | None) -> dict[str, int]:
    pids = {"launcher": stack.proc.pid, "engine": int(status["pid"])}
    pids["api"] = int(status["api"]["pid"])
    for r in status["ranks"]:
        pids[f"rank {r['rank']}"] = int(r["pid"])
    if nats_pid:
        pids["nats-server"] = nats_pid
    return pids


async def _status(c: httpx.AsyncClient) -> dict[str, Any]:
    r = await c.get("/v1/status")
    r.raise_for_status()
    return dict(r.json())


async def _call(
    res: SoakResult,
    bus: Bus,
    c: httpx.AsyncClient,
    subjects: Subjects,
    i: int,
    pick: tuple[str, str, dict[str, str], int],
    http: bool,
    version: str,
) -> None:
    method, route, query, _ = pick
    rid = f"soak{i}x{uuid.uuid4().hex[:8]}"
    args: dict[str, Any] = dict(query)
    if method == "update_weights":
        args = {"version": version}
    t0 = time.perf_counter()
    transport = "http" if http else "nats"
    try:
        if http:
            verb, path = route.split()
            kw: dict[str, Any] = {"headers": {"X-Request-Id": rid}}
            if method == "update_weights":
                kw["json"] = args
            else:
                kw["params"] = query
            r = await asyncio.wait_for(c.request(verb, path, **kw), CALL_BOUND_S)
            code = r.status_code
            body = r.json()
            echoed = r.headers.get("x-request-id")
            got = echoed if echoed is not None else body.get("request_id", rid)
            msg = str(body.get("error_message", ""))
        else:
            rep = await asyncio.wait_for(
                bus.request(
                    subjects.ctl(method),
                    json.dumps(args).encode(),
                    timeout=CALL_BOUND_S - 5,
                    request_id=rid,
                ),
                CALL_BOUND_S,
            )
            body = json.loads(rep.data)
            code, got, msg = body["error_code"], body["request_id"], body["error_message"]
    except TimeoutError:
        res.hung += 1
        res.unexpected.append(f"{transport} {method}{query}: no answer in {CALL_BOUND_S:g}s")
        return
    except ControlError as e:  # the bus's own timeout: the reply never came
        res.lost += 1
        res.unexpected.append(f"{transport} {method}{query}: {e.message}")
        return
    ms = (time.perf_counter() - t0) * 1e3
    res.latency[transport].append(ms)
    if got != rid:
        res.crossed += 1
        res.unexpected.append(f"{transport} {method}: sent {rid}, got {got}")
    label = " ".join([method, *query.values()])
    res.codes[f"{code}"] += 1
    res.by_method[label][code] += 1
    if code == 200:
        res.ok_ms[label].append(ms)
    if code == 503 and "no reply" in msg:
        res.lost += 1
    if code == 409:
        res.conflicts[f"{label}: {msg[:70]}"] += 1
    if code not in (200, 409):
        res.unexpected.append(f"{transport} {method}{query}: {code} {msg}")


async def _stream_loop(
    res: SoakResult, c: httpx.AsyncClient, i: int, stop: asyncio.Event, rng: random.Random
) -> None:
    while not stop.is_set():
        body = {
            "model": "tiny",
            "prompt": [rng.randrange(1, 250) for _ in range(rng.randint(4, 24))],
            "max_tokens": rng.randint(8, 32),
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

        async def one(body: dict[str, Any] = body) -> str:
            end = "no finish"
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return f"http {r.status_code}"
                ids = set()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        ids.add(chunk.get("id"))
                        if "error" in chunk:
                            return f"error {chunk['error'].get('code')}"
                        fin = chunk["choices"][0].get("finish_reason")
                        if fin:
                            end = str(fin)
            if len(ids) > 1:  # every chunk of one stream carries its one id
                res.crossed += 1
                res.unexpected.append(f"stream {i}: chunks of several requests {ids}")
            return end

        try:
            end = await asyncio.wait_for(one(), STREAM_BOUND_S)
        except TimeoutError:
            res.hung += 1
            end = "hung"
        except httpx.HTTPError as e:
            end = f"error {type(e).__name__}"
        res.streams += 1
        res.stream_ends[end] += 1


async def soak(
    stack: Stack,
    calls: int,
    streams: int,
    *,
    seed: int = 0,
    http_share: float = 0.25,
    workers: int = 4,
    jitter_ms: float = 5.0,
    nats_pid: int | None = None,
    progress: bool = False,
) -> SoakResult:
    res = SoakResult()
    subjects = Subjects(stack.instance)
    bus = await Bus.connect(stack.nats_url, "rollbus-soak")
    limits = httpx.Limits(max_connections=streams + workers + 4)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60, limits=limits) as c:
        st = await _status(c)
        version = st["weight_version"]
        pids = processes(stack, st, nats_pid)
        stop = asyncio.Event()
        gens = [
            asyncio.create_task(_stream_loop(res, c, i, stop, random.Random(seed * 100 + i)))
            for i in range(streams)
        ]
        # warm-up (allocator pools, connection pools, first steps) before "before"
        for _ in range(3):
            await c.get("/v1/is_paused")
        await asyncio.sleep(1.0)
        res.rss_before = {name: rss(pid) for name, pid in pids.items()}
        # caller 0 is the operator: state changes only; caller 1 mixes everything (its
        # state changes race the operator's: 409 when the control lock is held); the
        # others only read (is_paused, status), which always answer
        mutating = [p for p in MIX if p[0] not in ("is_paused", "status")]
        reads = [p for p in MIX if p not in mutating]
        mixes = [mutating, MIX, reads]
        todo = iter(range(calls))
        t0 = time.perf_counter()

        async def worker(w: int) -> None:
            wrng = random.Random(seed * 1000 + w)
            for i in todo:
                mix = mixes[min(w, 2)]
                pick = wrng.choices(mix, [p[3] for p in mix])[0]
                await _call(res, bus, c, subjects, i, pick, wrng.random() < http_share, version)
                res.calls += 1
                if res.calls % max(1, calls // 4) == 0:  # the trend: growth that levels off
                    for name, pid in pids.items():
                        res.rss_trend[name].append(rss(pid))
                if progress and res.calls % 1000 == 0:
                    print(f"soak: {res.calls}/{calls} calls", file=sys.stderr, flush=True)
                await asyncio.sleep(wrng.uniform(0, jitter_ms) / 1e3)

        await asyncio.gather(*(worker(w) for w in range(workers)))
        res.seconds = time.perf_counter() - t0
        # leave the engine awake and running, then let the streams end
        stop.set()
        await c.post("/v1/wakeup", params={"tags": "kv_cache"})
        await c.post("/v1/resume")
        await asyncio.wait_for(asyncio.gather(*gens), STREAM_BOUND_S)
        # pending maps back to 0 (a periodic rank ping may be in flight: look again)
        for _ in range(50):
            st = await _status(c)
            res.pending = {"engine": st["bus"]["pending"], "api": st["api"]["bus"]["pending"]}
            res.dropped = {"engine": st["bus"]["dropped"], "api": st["api"]["bus"]["dropped"]}
            if not any(res.pending.values()):
                break
            await asyncio.sleep(0.1)
        res.rss_after = {name: rss(pid) for name, pid in pids.items()}
    res.pending["client"] = bus.pending
    await bus.close()
    return res


def report(res: SoakResult, title: str) -> str:
    mb = 1024 * 1024
    lat = []
    for t, xs in res.latency.items():
        if xs:
            lat.append(
                f"| {t} | {len(xs)} | {statistics.median(xs):.2f} | {pct(xs, 99):.2f} | "
                f"{max(xs):.1f} |"
            )
    rss_rows = [
        f"| {name} | {res.rss_before[name] / mb:.1f} | "
        f"{' → '.join(f'{x / mb:.1f}' for x in res.rss_trend[name])} | "
        f"{res.rss_after[name] / mb:.1f} | "
        f"{(res.rss_after[name] - res.rss_before[name]) / mb:+.1f} |"
        for name in res.rss_before
    ]
    codes = ", ".join(f"{k}: {v}" for k, v in sorted(res.codes.items()))
    methods = [
        f"| {name} | {sum(c.values())} | {c[200]} | "
        f"{statistics.median(res.ok_ms[name]) if res.ok_ms[name] else 0:.1f} | {c[409]} | "
        f"{sum(v for k, v in c.items() if k not in (200, 409))} |"
        for name, c in sorted(res.by_method.items())
    ]
    ends = ", ".join(f"{k}: {v}" for k, v in sorted(res.stream_ends.items()))
    return "\n".join(
        [
            f"\n### {title}\n",
            f"{res.calls} control calls in {res.seconds:.1f}s ({codes}); "
            f"lost {res.lost}, crossed {res.crossed}, hung {res.hung}; "
            f"pending after: {res.pending}; dropped late replies: {res.dropped}",
            f"\n{res.streams} generation requests beside them ({ends})\n",
            "| method | calls | 200 | p50 ms of the 200s | 409 (lock held / wrong state) | other |",
            "|---|---|---|---|---|---|",
            *methods,
            "\n| transport | calls | p50 ms | p99 ms | max ms |",
            "|---|---|---|---|---|",
            *lat,
            "\n| process | RSS before MB | at each quarter of the calls | after MB | growth MB |",
            "|---|---|---|---|---|",
            *rss_rows,
            *(["\nunexpected answers (first 10):", *res.unexpected[:10]] if res.unexpected else []),
        ]
    )


def run(
    tmp: Path, nats_url: str, calls: int = 10_000, streams: int = 16, nats_pid: int | None = None
) -> str:
    stack = start_stack_retry(tmp / "soak", nats_url, tp=2,
                              env={"ROLLBUS_CONTROL_TIMEOUT_S": "20"})
    try:
        res = asyncio.run(soak(stack, calls, streams, nats_pid=nats_pid, progress=True))
    finally:
        stack.stop()
    return report(
        res,
        f"Soak: {calls} mixed control calls (25% over HTTP, 4 callers, 0-5 ms jitter) beside "
        f"{streams} generation streams, tp=2",
    )
