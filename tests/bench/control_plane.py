"""Control-plane latency, like with like, at tp=2 and tp=4.

Every path is called by the same raw nats-py client (or the same httpx client), so the
difference to its baseline is what rollbus adds on the server side:

* engine-only calls (``is_paused``; ``pause`` then ``resume``; ``status``, answered in
  one hop from the engine's view of the ranks, refreshed every ``RANK_REFRESH_S`` and
  after every operation that changes them) against raw request/reply to one responder
  process (once; twice);
* ``status`` with ``{"fresh": true}``, which asks every rank on the call (client →
  engine, engine → every rank), against a raw relay process that scatter-gathers to N
  responder processes of its own per request (the same two hops and processes; target
  <= 1.5×) and against the client's own one-hop scatter to N responder processes, the
  ratio issue 10 names (target <= 1.5×, though a two-hop call's floor is one
  request/reply plus one scatter). (KV ``sleep`` then ``wakeup`` and a no-op update
  are left out: each does real work on every rank, ≈ 0.5 s: not a control-plane
  latency);
* HTTP ``GET /v1/is_paused`` (and ``/v1/status``) against a bare Starlette route, same
  uvicorn settings, that does one raw NATS request. Target: is_paused <= 1.3×.

Every raw reply is padded to the size of the rollbus reply it stands for (measured from
the stack first). A run calls every path ``calls`` times in turn (baselines interleaved
with ours); a cell is the median over runs of each run's p50 ms.
"""

from __future__ import annotations

import asyncio
import json
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


async def reply_sizes(nc: Any, s: Subjects) -> dict[str, int]:
    """Bytes of the rollbus replies the raw baselines stand for (like with like: the same
    message sizes): ``is_paused``, ``status``, one rank's entry of a fresh ``status``."""
    isp = await nc.request(s.ctl("is_paused"), b"{}", timeout=30)
    st = await nc.request(s.ctl("status"), b'{"fresh":true}', timeout=30)
    ranks = json.loads(st.data)["result"]["ranks"]
    rank = max(len(json.dumps(r, separators=(",", ":"))) for r in ranks)
    return {"is_paused": len(isp.data), "status": len(st.data), "rank": rank + 64}


async def measure(
    url: str, instance: str, base_url: str, tp: int, calls: int, runs: int
) -> dict[str, list[list[float]]]:
    """{path: [latencies ms of run 1, run 2, ...]}."""
    tag = uuid.uuid4().hex[:8]
    single, scat = f"bench.req.{tag}", f"bench.scatter.{tag}"
    relay_subj, relay_scat = f"bench.relay.{tag}", f"bench.relayscatter.{tag}"
    nc = await nats.connect(url)
    s = Subjects(instance)
    size = await reply_sizes(nc, s)
    log.info("control tp=%d: reply bytes %s", tp, size)
    procs = [_spawn("tests.bench.responder", url, single, "1", "--size", str(size["is_paused"]))]
    procs += [_spawn("tests.bench.responder", url, scat, "1", str(i), "--size",
                     str(size["rank"])) for i in range(tp)]
    # the two-hop baseline: a raw relay process ("engine") and its own N responders
    procs += [_spawn("tests.bench.responder", url, relay_subj, "1", "--size",
                     str(size["status"]), "--relay", relay_scat, str(tp))]
    procs += [_spawn("tests.bench.responder", url, relay_scat, "1", str(i), "--size",
                     str(size["rank"])) for i in range(tp)]
    port = free_port()
    bare = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.bare_http", url, single, str(port)]
    )
    try:
        for p in procs:
            _ready(p)
        bare_url = f"http://127.0.0.1:{port}"
        await _wait_http(bare_url + "/bare")
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

        async def relayed() -> None:
            await nc.request(relay_subj, b"{}", timeout=5)

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

            n = names(tp)
            paths = [
                (n["req"], req, calls),
                (n["is_paused"], is_paused, calls),
                (n["req2"], req2, calls),
                (n["pause_resume"], pause_resume, calls),
                (n["status"], status, calls),
                (n["scatter"], scatter, calls),
                (n["relay"], relayed, calls),
                (n["fresh"], status_fresh, calls),
                (n["bare"], http_bare, calls),
                (n["http_is_paused"], http_is_paused, calls),
                (n["http_status"], http_status, calls),
            ]
            out: dict[str, list[list[float]]] = {name: [] for name, _, _ in paths}
            for run in range(runs):
                for name, fn, n in paths:
                    out[name].append(await timed(fn, n, warmup=20 if run == 0 else 3))
                log.info("control tp=%d run %d/%d done", tp, run + 1, runs)
        return out
    finally:
        await nc.close()
        for p in [*procs, bare]:
            p.terminate()
        for p in [*procs, bare]:
            p.wait()


def names(tp: int) -> dict[str, str]:
    """The paths (rows) of the control table at ``tp``."""
    return {
        "req": "raw request/reply (1 responder process)",
        "is_paused": "rollbus is_paused over NATS",
        "req2": "raw request/reply ×2",
        "pause_resume": "rollbus pause→resume over NATS",
        "status": "rollbus status over NATS (the engine's view: no rank asked on the call)",
        "status_vs_scatter": "rollbus status over NATS, against the one-hop scatter (no "
        "target: no rank is asked on the call)",
        "scatter": f"raw scatter-gather to {tp} responder processes (one hop)",
        "relay": f"raw request → relay process → scatter-gather to {tp} responder processes "
        "(two hops, as rollbus)",
        "fresh": "rollbus status?fresh over NATS (every rank asked on the call)",
        "fresh_vs_scatter": "rollbus status?fresh, against the one-hop scatter",
        "bare": "bare starlette route + 1 raw NATS request",
        "http_is_paused": "rollbus is_paused over HTTP",
        "http_status": "rollbus status over HTTP",
    }


def tables(tp: int, calls: int, res: dict[str, list[list[float]]]) -> Table:
    """Each rollbus path against the raw path of the same shape: the same hops, the same
    number of processes, replies of the same size. Engine-only calls (``is_paused``,
    ``pause``→``resume``, ``status`` from the engine's view) against raw request/reply;
    the call that asks every rank (``status?fresh``: client → engine → every rank) against
    a raw relay process that scatter-gathers to N responder processes (target <= 1.5×),
    and — the ratio issue 10 names — against the client's own one-hop scatter (target
    <= 1.5×, kept though its floor is one request/reply plus one scatter)."""
    n = names(tp)
    t = Table(
        f"control_tp{tp}",
        f"Control plane, tp={tp}: p50 latency per run of {calls} sequential calls",
        "p50 ms",
    )
    spec: list[tuple[str, str, str | None, tuple[str, float] | None]] = [
        ("req", "req", None, None),
        ("is_paused", "is_paused", "req", None),
        ("req2", "req2", None, None),
        ("pause_resume", "pause_resume", "req2", None),
        ("status", "status", "req", None),
        ("scatter", "scatter", None, None),
        ("relay", "relay", None, None),
        ("fresh", "fresh", "relay", ("<=", 1.5)),
        ("fresh_vs_scatter", "fresh", "scatter", ("<=", 1.5)),
        ("status_vs_scatter", "status", "scatter", None),
        ("bare", "bare", None, None),
        ("http_is_paused", "http_is_paused", "bare", ("<=", 1.3)),
        ("http_status", "http_status", "bare", None),
    ]
    for key, src, base, target in spec:
        t.add(n[key], values=[statistics.median(x) for x in res[n[src]]],
              baseline=n[base] if base else None, target=target)
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
