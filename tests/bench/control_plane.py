"""Control-plane latency, like with like, at tp=2 and tp=4.

Every path is called by the same raw nats-py client (or the same httpx client), so the
difference to its baseline is what rollbus adds on the server side:

* engine-only calls (``is_paused``; ``pause`` then ``resume``) against raw request/reply
  to one responder process (once; twice in a row);
* ``status``, which reports every rank, against a raw scatter-gather to N responders,
  each responder its own process, as each rank is. Target: <= 1.5× the raw scatter p50.
  ``status`` answers in one hop from the engine's view of the ranks (refreshed every
  ``RANK_REFRESH_S`` and after every operation that changes them); ``status`` with
  ``{"fresh": true}`` asks every rank now — two hops (client → engine, engine → every
  rank), so its floor is one raw request/reply plus one raw scatter: shown, no target.
  (KV ``sleep`` then ``wakeup`` is left out: each frees and reallocates the KV cache and
  trims memory on every rank, ≈ 0.5 s: not a control-plane latency);
* HTTP ``GET /v1/is_paused`` (and ``/v1/status``) against a bare Starlette route, same
  uvicorn settings, that does one raw NATS request. Target: is_paused <= 1.3×.

A run calls every path ``calls`` times in turn (baselines interleaved with ours); a cell
is the median over runs of each run's p50 ms.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import nats

from shared.subjects import Subjects
from tests.bench.common import Table, pct, start_stack_retry, timed
from tests.e2e.stack import free_port

log = logging.getLogger("bench")


def _spawn(*args: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, text=True)
    return p


def _ready(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None
    line = p.stdout.readline()
    if "ready" not in line:
        raise RuntimeError(f"{p.args} did not start: {line!r}")


async def _wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while True:
            try:
                await c.get(url, timeout=1)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


async def measure(
    url: str, instance: str, base_url: str, tp: int, calls: int, runs: int
) -> dict[str, list[list[float]]]:
    """{path: [latencies ms of run 1, run 2, ...]}."""
    tag = uuid.uuid4().hex[:8]
    single, scat = f"bench.req.{tag}", f"bench.scatter.{tag}"
    procs = [_spawn("tests.bench.responder", url, single, "1")]
    procs += [_spawn("tests.bench.responder", url, scat, "1", str(i)) for i in range(tp)]
    port = free_port()
    bare = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.bare_http", url, single, str(port)]
    )
    try:
        for p in procs:
            _ready(p)
        bare_url = f"http://127.0.0.1:{port}"
        await _wait_http(bare_url + "/bare")
        nc = await nats.connect(url)
        s = Subjects(instance)
        inbox = nc.new_inbox()
        queue: asyncio.Queue[object] = asyncio.Queue()

        async def on_reply(msg: Any) -> None:
            queue.put_nowait(msg)

        await nc.subscribe(inbox, cb=on_reply)
        await nc.flush()
        await nc.flush()

        async def req() -> None:
            await nc.request(single, b"{}", timeout=5)

        async def req2() -> None:
            await req()
            await req()

        async def scatter() -> None:
            await nc.publish(scat, b"{}", reply=inbox)
            for _ in range(tp):
                await asyncio.wait_for(queue.get(), 5)

        async def ctl(method: str, body: bytes = b"{}") -> None:
            rep = await nc.request(s.ctl(method), body, timeout=30)
            if b'"error_code":200' not in rep.data:
                raise RuntimeError(f"{method}: {rep.data[:300]!r}")

        async def is_paused() -> None:
            await ctl("is_paused")

        async def pause_resume() -> None:
            await ctl("pause")
            await ctl("resume")

        async def status() -> None:
            await ctl("status")

        async def status_fresh() -> None:
            await ctl("status", b'{"fresh":true}')

        async with httpx.AsyncClient(base_url=base_url, timeout=30) as api, httpx.AsyncClient(
            base_url=bare_url, timeout=30
        ) as bc:

            async def http_bare() -> None:
                (await bc.get("/bare")).raise_for_status()

            async def http_is_paused() -> None:
                (await api.get("/v1/is_paused")).raise_for_status()

            async def http_status() -> None:
                (await api.get("/v1/status")).raise_for_status()

            paths = [
                ("raw request/reply", req, calls),
                ("rollbus is_paused over NATS", is_paused, calls),
                ("raw request/reply ×2", req2, calls),
                ("rollbus pause→resume over NATS", pause_resume, calls),
                (f"raw scatter-gather to {tp} responder processes", scatter, calls),
                ("rollbus status over NATS", status, calls),
                ("rollbus status?fresh over NATS (two hops)", status_fresh, calls),
                ("bare starlette route + 1 raw NATS request", http_bare, calls),
                ("rollbus is_paused over HTTP", http_is_paused, calls),
                ("rollbus status over HTTP", http_status, calls),
            ]
            out: dict[str, list[list[float]]] = {name: [] for name, _, _ in paths}
            for run in range(runs):
                for name, fn, n in paths:
                    out[name].append(await timed(fn, n, warmup=20 if run == 0 else 3))
                log.info("control tp=%d run %d/%d done", tp, run + 1, runs)
        await nc.close()
        return out
    finally:
        for p in [*procs, bare]:
            p.terminate()
        for p in [*procs, bare]:
            p.wait()


def tables(tp: int, calls: int, res: dict[str, list[list[float]]]) -> Table:
    scat = f"raw scatter-gather to {tp} responder processes"
    t = Table(
        f"control_tp{tp}",
        f"Control plane, tp={tp}: p50 latency per run of {calls} sequential calls",
        "p50 ms",
    )
    spec: list[tuple[str, str | None, tuple[str, float] | None]] = [
        ("raw request/reply", None, None),
        ("rollbus is_paused over NATS", "raw request/reply", None),
        ("raw request/reply ×2", None, None),
        ("rollbus pause→resume over NATS", "raw request/reply ×2", None),
        (scat, None, None),
        ("rollbus status over NATS", scat, ("<=", 1.5)),
        ("rollbus status?fresh over NATS (two hops)", scat, None),
        ("bare starlette route + 1 raw NATS request", None, None),
        ("rollbus is_paused over HTTP", "bare starlette route + 1 raw NATS request", ("<=", 1.3)),
        ("rollbus status over HTTP", "bare starlette route + 1 raw NATS request", None),
    ]
    for name, base, target in spec:
        t.add(name, values=[statistics.median(x) for x in res[name]], baseline=base,
              target=target)
    p99 = {name: statistics.median(pct(x, 99) for x in runs) for name, runs in res.items()}
    t.notes.append(
        "p99 ms (median over runs): "
        + "; ".join(f"{k} {v:.2f}" for k, v in p99.items())
    )
    return t


def run(tmp: Path, nats_url: str, calls: int = 200, runs: int = 5,
        tps: tuple[int, ...] = (2, 4)) -> list[Table]:
    out = []
    for tp in tps:
        stack = start_stack_retry(tmp / f"tp{tp}", nats_url, tp=tp)
        try:
            res = asyncio.run(measure(nats_url, stack.instance, stack.base_url, tp, calls, runs))
        finally:
            stack.stop()
        out.append(tables(tp, calls, res))
    return out
