"""Control-plane latency: is_paused and pause→resume through NATS and HTTP, with 2 and
4 ranks, beside raw nats-py request/reply and raw scatter-gather to the same number of
responders (separate processes), measured in the same run."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import nats

from shared.bus import Bus
from shared.subjects import Subjects
from tests.bench.common import row, table, timed
from tests.e2e.stack import start_stack


async def raw_baselines(url: str, n_resp: int, calls: int) -> tuple[list[float], list[float]]:
    subj = f"bench.raw.{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.responder", url, subj, str(n_resp)],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
        nc = await nats.connect(url)
        # raw request/reply: stock nats-py request() to one responder
        single = f"{subj}.single"
        one = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.responder", url, single, "1"],
            stdout=subprocess.PIPE,
        )
        assert one.stdout is not None
        await asyncio.get_running_loop().run_in_executor(None, one.stdout.readline)
        req = await timed(lambda: nc.request(single, b"{}", timeout=5), calls)
        one.terminate()
        # raw scatter-gather: one publish, wait for n replies on a plain inbox
        inbox = nc.new_inbox()
        queue: asyncio.Queue[object] = asyncio.Queue()

        async def on_reply(msg):  # noqa: ANN001
            queue.put_nowait(msg)

        await nc.subscribe(inbox, cb=on_reply)

        async def scatter() -> None:
            await nc.publish(subj, b"{}", reply=inbox)
            for _ in range(n_resp):
                await asyncio.wait_for(queue.get(), 5)

        sc = await timed(scatter, calls)
        await nc.close()
        return req, sc
    finally:
        proc.terminate()


async def through_rollbus(
    url: str, instance: str, base_url: str, calls: int
) -> dict[str, list[float]]:
    bus = await Bus.connect(url, "bench")
    s = Subjects(instance)
    out: dict[str, list[float]] = {}
    out["nats is_paused"] = await timed(
        lambda: bus.request(s.ctl("is_paused"), b"{}", timeout=10), calls
    )

    async def cycle_nats() -> None:
        await bus.request(s.ctl("pause"), b"{}", timeout=10)
        await bus.request(s.ctl("resume"), b"{}", timeout=10)

    out["nats pause→resume"] = await timed(cycle_nats, calls)
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as c:
        out["http is_paused"] = await timed(lambda: c.get("/v1/is_paused"), calls)

        async def cycle_http() -> None:
            await c.post("/v1/pause")
            await c.post("/v1/resume")

        out["http pause→resume"] = await timed(cycle_http, calls)
    await bus.close()
    return out


def run(tmp: Path, nats_url: str, calls: int = 500, tps: tuple[int, ...] = (2, 4)) -> str:
    parts = []
    for tp in tps:
        stack = start_stack(tmp / f"tp{tp}", nats_url, tp=tp)
        try:
            req, sc = asyncio.run(raw_baselines(nats_url, tp, calls))
            ours = asyncio.run(through_rollbus(nats_url, stack.instance, stack.base_url, calls))
        finally:
            stack.stop()
        r50, s50 = statistics.median(req), statistics.median(sc)
        rows = [
            row("raw nats-py request/reply", req),
            row(f"raw scatter-gather to {tp} responders", sc, r50),
            row("rollbus is_paused over NATS", ours["nats is_paused"], r50),
            row("rollbus is_paused over HTTP", ours["http is_paused"], r50),
            row("rollbus pause→resume over NATS", ours["nats pause→resume"], s50),
            row("rollbus pause→resume over HTTP", ours["http pause→resume"], s50),
        ]
        parts.append(
            table(
                f"Control plane, tp={tp}, {calls} calls each (ratios: is_paused vs "
                f"raw request/reply, pause→resume vs raw scatter)",
                rows,
            )
        )
        target = statistics.median(ours["nats pause→resume"]) / s50
        parts.append(f"\npause→resume over NATS / raw scatter p50 = {target:.2f}× (target ≤ 3×)")
    return "\n".join(parts)
