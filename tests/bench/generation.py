"""Generation throughput: rollbus over HTTP (and the bus) against transformers' ``generate``
on the same weights and batch, and against the same ranks stepping with no bus
(``selfbench``), at TP=2 and TP=1 in the same run; time-to-abort with 16 running requests.

The model is built with transformers' own classes (:mod:`tests.bench.hf_generate`) and
both stacks serve that directory, so every row computes the same thing."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
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

MODEL = {  # the 8-layer hidden-1024 fp32 model (≈ 390 MiB)
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}
TPS = (2, 1)  # both stacks in the same run: 2 ranks x 1 thread, 1 rank x 2 threads
PROMPT_LEN = 16
STEPS = 64


async def baseline(bus: Bus, s: Subjects, batch: int, tp: int, prefill: bool = False) -> float:
    """``selfbench``: decode steps only, or with ``prefill`` the prompts' prefill step too
    (which yields the first token: the same work as over HTTP)."""
    args = m.json_encode(
        m.SelfBenchArgs(batch=batch, steps=STEPS, prompt_len=PROMPT_LEN, prefill=prefill)
    )
    reps = await bus.scatter(s.worker_ctl("selfbench"), args, expected=tp, timeout=600)
    rep = m.json_decode(reps[0].data, type=m.WorkerReply)
    assert rep.error_code == 200, rep.error_message
    return float(rep.result["tokens_per_s"])


def _gen(i: int) -> m.GenRequest:
    prompt = [256] + [(7 * i + j) % 250 for j in range(PROMPT_LEN - 1)]
    return m.GenRequest(uuid.uuid4().hex, prompt, STEPS, temperature=0.0)


async def via_bus(bus: Bus, s: Subjects, batch: int) -> float:
    async def one(i: int) -> int:
        n, gen = 0, _gen(i)
        # the engine echoes the request's id in each chunk's header: correlate on it
        stream = bus.stream(s.gen, m.pack(gen), idle_timeout=120, request_id=gen.request_id)
        async for rep in stream:
            c = m.unpack(rep.data, type=m.GenChunk)
            n += len(c.token_ids)
            if c.finish_reason:
                return n
        return n

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one(i) for i in range(batch))))
    return total / (time.perf_counter() - t0)


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "bench",
        "prompt": [256] + [(7 * i + j) % 250 for j in range(PROMPT_LEN - 1)],
        "max_tokens": STEPS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


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


async def via_raw_http(base: str, batch: int) -> float:
    """The non-streamed requests of :func:`via_http` written by a minimal HTTP/1.1 client
    (one connection each, ``Connection: close``, the JSON body read whole): the same
    requests and answers without httpx's own per-request work, which on 2 cores delays
    the batch's start (docs/generation-speed-log.md, session 10)."""
    host, port = base.split("//")[1].rsplit(":", 1)

    async def one(i: int) -> int:
        r, w = await asyncio.open_connection(host, int(port))
        body = json.dumps(_body(i, False)).encode()
        w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        data = await r.read()
        w.close()
        return int(json.loads(data.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"])

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


class HFBaseline:
    """transformers' ``generate`` in its own process (see :mod:`tests.bench.hf_generate`)."""

    def __init__(self, model_dir: Path, batch: int, log_path: Path) -> None:
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.bench.hf_generate",
                "serve",
                str(model_dir),
                str(batch),
                str(PROMPT_LEN),
                str(STEPS),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            tail = log_path.read_text()[-2000:]
            raise RuntimeError(f"transformers baseline did not start: {tail}")

    def run(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return float(json.loads(self.proc.stdout.readline())["tokens_per_s"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run(
    tmp: Path,
    nats_url: str,
    runs: int = 5,
    quick: bool = False,
    model: dict[str, Any] | None = None,
) -> list[Table]:
    global STEPS
    STEPS = 8 if quick else 64
    model_dir = tmp / "gen" / "models" / "bench"
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.bench.hf_generate",
            "build",
            str(model_dir),
            json.dumps(model or MODEL),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if built.returncode:  # e.g. no torch / transformers: `just compat` installs them
        raise RuntimeError(
            f"building the bench model with transformers failed:\n{built.stderr[-2000:]}"
        )
    stacks: dict[int, Stack] = {}
    hf: HFBaseline | None = None
    try:
        for tp in TPS:
            stacks[tp] = start_stack_retry(
                tmp / f"gen-tp{tp}",
                nats_url,
                tp=tp,
                model_dir=model_dir,
                model_name="bench",
                env={
                    "ROLLBUS_KV_CACHE_BLOCKS": "1024" if tp == 2 else "256",
                    "ROLLBUS_CONTROL_TIMEOUT_S": "120",
                },
            )
        # the default's effect, in the same run: the same TP=2 stack at one decode
        # iteration a step (``ROLLBUS_DECODE_STEPS=1``, every message per token)
        one = start_stack_retry(
            tmp / "gen-tp2-k1",
            nats_url,
            tp=2,
            model_dir=model_dir,
            model_name="bench",
            env={
                "ROLLBUS_KV_CACHE_BLOCKS": "1024",
                "ROLLBUS_CONTROL_TIMEOUT_S": "120",
                "ROLLBUS_DECODE_STEPS": "1",
            },
        )
        stacks[-1] = one
        hf = HFBaseline(model_dir, 16, tmp / "gen" / "hf.log")
        cfg = json.loads((model_dir / "config.json").read_text())
        return asyncio.run(_run(stacks, hf, cfg, runs))
    finally:
        if hf is not None:
            hf.stop()
        for stack in stacks.values():
            stack.stop()


HF = "transformers generate (torch CPU fp32, threads = cores)"


def _inproc(tp: int) -> str:
    return f"in-process tp={tp} (ranks step with no bus, `selfbench`)"


def _inproc_prefill(tp: int) -> str:
    return f"in-process tp={tp}, prefill + decode (same work as HTTP)"


def _raw_client(tp: int) -> str:
    return f"HTTP, minimal client (no httpx) tp={tp}"


ONE_ITER = "HTTP tp=2, one decode iteration a step (`ROLLBUS_DECODE_STEPS=1`)"


def _same_work(tp: int) -> str:
    return f"HTTP tp={tp}, against in-process prefill + decode (same work)"


async def _run(
    stacks: dict[int, Stack], hf: HFBaseline, cfg: dict[str, Any], runs: int
) -> list[Table]:
    stacks = dict(stacks)  # the caller's keeps every stack, to stop them
    one = stacks.pop(-1, None)
    buses = {tp: await Bus.connect(st.nats_url, f"bench-gen-tp{tp}") for tp, st in stacks.items()}
    subj = {tp: Subjects(st.instance) for tp, st in stacks.items()}
    size = (
        f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"vocab {cfg['vocab_size']}, fp32"
    )
    cores = os.cpu_count()
    out = []
    try:
        for batch in (1, 16):
            for tp in TPS:
                await via_bus(buses[tp], subj[tp], batch)  # warm up
            t = Table(
                f"generation_b{batch}",
                f"Generation, batch {batch}, model {size}; {PROMPT_LEN}-token prompts, "
                f"{STEPS} output tokens each (greedy, ignore_eos); {cores} CPUs: output tokens/s",
                "tokens/s",
            )
            rows: dict[str, list[float]] = {}
            for _ in range(runs):
                if batch == 16:
                    rows.setdefault(HF, []).append(hf.run())
                for tp in TPS:
                    bus, s, st = buses[tp], subj[tp], stacks[tp]
                    rows.setdefault(_inproc(tp), []).append(await baseline(bus, s, batch, tp))
                    if batch == 16:
                        rows.setdefault(_inproc_prefill(tp), []).append(
                            await baseline(bus, s, batch, tp, prefill=True)
                        )
                    rows.setdefault(f"engine over NATS tp={tp}", []).append(
                        await via_bus(bus, s, batch)
                    )
                    http = await via_http(st.base_url, batch, stream=False)
                    rows.setdefault(f"HTTP tp={tp}", []).append(http)
                    if batch == 16:
                        rows.setdefault(f"HTTP tp={tp}, against transformers", []).append(http)
                        rows.setdefault(_same_work(tp), []).append(http)
                    rows.setdefault(f"HTTP stream tp={tp}", []).append(
                        await via_http(st.base_url, batch, stream=True)
                    )
                    if batch == 16:  # the same requests without httpx's work: no target
                        rows.setdefault(_raw_client(tp), []).append(
                            await via_raw_http(st.base_url, batch)
                        )
                    if batch == 16 and tp == 2 and one is not None:
                        rows.setdefault(ONE_ITER, []).append(
                            await via_http(one.base_url, batch, stream=False)
                        )
            for name, vals in rows.items():
                base: str | None
                target: tuple[str, float] | None = None
                if name == HF:
                    base = None
                elif name == ONE_ITER:
                    base = _inproc(2)  # what the default's iterations save: no target
                elif name.startswith("in-process") and "prefill" in name:
                    base = _inproc(int(name.split("tp=")[1][0]))  # the prefill's share; no target
                elif name.startswith("in-process"):
                    base = HF if batch == 16 else None
                elif name.endswith("against transformers"):
                    base, target = HF, (">=", 1.0)
                elif name.endswith("(same work)"):
                    # like with like: the in-process loop doing what HTTP does (prefill too);
                    # the decode-only target above stays and is checked as well
                    base, target = _inproc_prefill(int(name.split("tp=")[1][0])), (">=", 0.9)
                else:
                    tp = int(name.split("tp=")[1][0])
                    base = _inproc(tp)
                    if batch == 16 and name.startswith("HTTP tp="):
                        target = (">=", 0.9)
                t.add(name, values=vals, baseline=base, target=target)
            if batch == 16:
                t.notes.append(
                    "transformers: `LlamaForCausalLM.generate` on the same safetensors "
                    "(built by transformers' own classes; rollbus serves that dir), in its own "
                    "process, prefill included. in-process: `selfbench`, decode steps only; "
                    "with prefill: the prompts' prefill step (the first token) and the "
                    "decode steps, as HTTP does them, shown against decode only (no target); "
                    "HTTP is checked against both in-process rows (>= 0.9x each). "
                    "HTTP: 16 concurrent `/v1/completions` requests (httpx), prefill included; "
                    "minimal client: the same requests written by a bare asyncio HTTP/1.1 "
                    "client, to show httpx's own share (no target). HTTP runs at the "
                    "default `ROLLBUS_DECODE_STEPS` (4 decode iterations a step message); "
                    "one decode iteration a step: a third stack, TP=2, set to 1 (no target)."
                )
            out.append(t)
            log.info("generation batch %d done", batch)
        abort = await time_to_abort(stacks[2].base_url, max(5, runs))
    finally:
        for bus in buses.values():
            await bus.close()
    t = Table(
        "abort", "Time to abort (tp=2): `POST /v1/pause` → last of 16 running streams ended", "ms"
    )
    t.add(f"one value per round ({len(abort)} rounds)", values=abort)
    out.append(t)
    return out
