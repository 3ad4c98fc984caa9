"""Generation throughput through the bus and HTTP vs the same model stepping on the ranks
with no bus (same run, same weights), and time-to-abort with 16 running requests."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from shared import messages as m
from shared.bus import Bus
from shared.subjects import Subjects
from tests.bench.common import pct
from tests.e2e.stack import Stack, start_stack

MODEL = {
    "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
}
PROMPT_LEN = 16
STEPS = 64


async def baseline(bus: Bus, s: Subjects, batch: int, tp: int) -> float:
    args = m.json_encode(m.SelfBenchArgs(batch=batch, steps=STEPS, prompt_len=PROMPT_LEN))
    reps = await bus.scatter(s.worker_ctl("selfbench"), args, expected=tp, timeout=600)
    rep = m.json_decode(reps[0].data, type=m.WorkerReply)
    assert rep.error_code == 200, rep.error_message
    return float(rep.result["tokens_per_s"])


def _gen(i: int) -> m.GenRequest:
    prompt = [256] + [(7 * i + j) % 250 for j in range(PROMPT_LEN - 1)]
    return m.GenRequest(uuid.uuid4().hex, prompt, STEPS, temperature=0.0)


async def via_bus(bus: Bus, s: Subjects, batch: int) -> float:
    async def one(i: int) -> int:
        n = 0
        async for rep in bus.stream(s.gen, m.pack(_gen(i)), idle_timeout=120):
            c = m.unpack(rep.data, type=m.GenChunk)
            n += len(c.token_ids)
            if c.finish_reason:
                return n
        return n

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one(i) for i in range(batch))))
    return total / (time.perf_counter() - t0)


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {"model": "bench", "prompt": [256] + [(7 * i + j) % 250 for j in range(PROMPT_LEN - 1)],
            "max_tokens": STEPS, "temperature": 0, "ignore_eos": True, "stream": stream}


async def via_http(base: str, batch: int, stream: bool) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        async def one(i: int) -> int:
            if not stream:
                r = await c.post("/v1/completions", json=_body(i, False))
                return int(r.json()["usage"]["completion_tokens"])
            n = 0
            async with c.stream("POST", "/v1/completions", json=_body(i, True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n += 1
            return n

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*(one(i) for i in range(batch))))
        return total / (time.perf_counter() - t0)


async def time_to_abort(base: str, rounds: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        for _ in range(rounds):
            seen = [0] * 16

            async def one(i: int, seen: list[int] = seen) -> float:
                body = {**_body(i, True), "max_tokens": 1500}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            seen[i] += 1
                            if '"finish_reason": "abort"' in line:
                                return time.perf_counter()
                return time.perf_counter()

            tasks = [asyncio.create_task(one(i)) for i in range(16)]
            while min(seen) < 1:
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            await c.post("/v1/pause")
            ends = await asyncio.gather(*tasks)
            out.append((max(ends) - t0) * 1e3)
            await c.post("/v1/resume")
    return out


def run(tmp: Path, nats_url: str, model: dict[str, Any] | None = None) -> str:
    stack: Stack = start_stack(
        tmp / "gen", nats_url, tp=2, model_config=model or MODEL, model_name="bench",
        env={"ROLLBUS_KV_CACHE_BLOCKS": "1024", "ROLLBUS_CONTROL_TIMEOUT_S": "120"},
    )
    try:
        return asyncio.run(_run(stack, json.loads((stack.model_dir / "config.json").read_text())))
    finally:
        stack.stop()


async def _run(stack: Stack, cfg: dict[str, Any]) -> str:
    bus = await Bus.connect(stack.nats_url, "bench-gen")
    s = Subjects(stack.instance)
    rows = []
    try:
        for batch in (1, 16):
            await via_bus(bus, s, batch)  # warm up
            base = await baseline(bus, s, batch, 2)
            b = await via_bus(bus, s, batch)
            hs = await via_http(stack.base_url, batch, stream=True)
            hn = await via_http(stack.base_url, batch, stream=False)
            rows.append(f"| {batch} | {base:.1f} | {b:.1f} ({b / base:.2f}×) | "
                        f"{hn:.1f} ({hn / base:.2f}×) | {hs:.1f} ({hs / base:.2f}×) |")
        abort = await time_to_abort(stack.base_url, 10)
    finally:
        await bus.close()
    size = (
        f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"vocab {cfg['vocab_size']}"
    )
    return "\n".join([
        f"\n### Generation throughput, tp=2, model {size}; {PROMPT_LEN}-token prompts, "
        f"{STEPS} output tokens each (output tokens/s, ratio to in-process)\n",
        "| batch | in-process (ranks, no bus) | engine over NATS | HTTP | HTTP stream |",
        "|---|---|---|---|---|",
        *rows,
        "\n### Time to abort: `POST /v1/pause` → last of 16 running streams ended "
        f"(10 rounds)\n\n| p50 ms | p99 ms |\n|---|---|\n"
        f"| {statistics.median(abort):.1f} | {pct(abort, 99):.1f} |",
    ])
