"""Generation throughput through the bus and HTTP vs the same model stepping on the ranks
with no bus (same run, same weights), and time-to-abort with 16 running requests."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from shared import messages as m
from shared.bus import Bus
from shared.subjects import Subjects
from tests.bench.common import Table, start_stack_retry
from tests.e2e.stack import Stack

log = logging.getLogger("bench")

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


def run(tmp: Path, nats_url: str, runs: int = 5, quick: bool = False,
        model: dict[str, Any] | None = None) -> list[Table]:
    global STEPS
    STEPS = 8 if quick else 32  # 32 output tokens per request keeps 5 runs near 3 minutes
    stack: Stack = start_stack_retry(
        tmp / "gen", nats_url, tp=2, model_config=model or MODEL, model_name="bench",
        env={"ROLLBUS_KV_CACHE_BLOCKS": "1024", "ROLLBUS_CONTROL_TIMEOUT_S": "120"},
    )
    try:
        cfg = json.loads((stack.model_dir / "config.json").read_text())
        return asyncio.run(_run(stack, cfg, runs))
    finally:
        stack.stop()


async def _run(stack: Stack, cfg: dict[str, Any], runs: int) -> list[Table]:
    bus = await Bus.connect(stack.nats_url, "bench-gen")
    s = Subjects(stack.instance)
    size = (
        f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"vocab {cfg['vocab_size']}"
    )
    out = []
    try:
        for batch in (1, 16):
            await via_bus(bus, s, batch)  # warm up
            t = Table(
                f"generation_b{batch}",
                f"Generation, tp=2, batch {batch}, model {size}; {PROMPT_LEN}-token prompts, "
                f"{STEPS} output tokens each: output tokens/s",
                "tokens/s",
            )
            base = "in-process (ranks step with no bus, same weights, `selfbench`)"
            rows = {base: [], "engine over NATS": [], "HTTP": [], "HTTP stream": []}
            for _ in range(runs):
                rows[base].append(await baseline(bus, s, batch, 2))
                rows["engine over NATS"].append(await via_bus(bus, s, batch))
                rows["HTTP"].append(await via_http(stack.base_url, batch, stream=False))
                rows["HTTP stream"].append(await via_http(stack.base_url, batch, stream=True))
            for name, vals in rows.items():
                t.add(name, values=vals, baseline=None if name == base else base,
                      target=(">=", 0.85) if batch == 16 and name != base else None)
            out.append(t)
            log.info("generation batch %d done", batch)
        abort = await time_to_abort(stack.base_url, max(5, runs))
    finally:
        await bus.close()
    t = Table("abort", "Time to abort: `POST /v1/pause` → last of 16 running streams ended",
              "ms")
    t.add(f"one value per round ({len(abort)} rounds)", values=abort)
    out.append(t)
    return out
