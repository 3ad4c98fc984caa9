"""Black-box soak of the comm-group rebuild (``SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE``): a
``python -m services.cli serve`` stack with the setting on, greedy generation streams on
fixed prompts, and a loop of pause -> sleep (all tags) -> wakeup -> resume, with
update_weights to two published versions alternately (while asleep, or paused), sleep and
wakeup racing with ``status?fresh`` / ``is_paused`` reads.

Checks: every greedy output for one prompt and version is the same across cycles (a
stream that saw an update is not compared), no call or stream past its bound, no 5xx, no
rank restart (rank pids in status), ``comm_group`` false while asleep and true after
wakeup; prints each rank's fds / threads / RSS growth a cycle (README "Limit: comm-group
rebuilds": +1 epoll fd, +TP-1 sockets, +1 thread a rebuild).

``python -m tests.bench.comm_soak --tp 2 --cycles 150 --time-box 900 --streams 6``
(``SOAK_ENV='{"ROLLBUS_TP_ALLREDUCE": "gloo"}'`` runs the model's all-reduce on the
rebuilt gloo group instead of shared memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from services.tiny_model import create_model_dir
from tests.e2e.stack import start_stack

PROMPTS = [
    [5, 17, 33, 2, 90],
    [100, 4, 4, 61, 7, 8, 9],
    [200, 150, 3],
    [11, 22, 33, 44, 55, 66, 77, 88],
]
MAX_TOK = 12
STREAM_TIMEOUT = 120.0
CALL_TIMEOUT = 60.0


def proc_stats(pid: int) -> tuple[int, int, int]:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        thr = rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                thr = int(line.split()[1])
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        return fds, thr, rss
    except OSError:
        return -1, -1, -1


class S:
    def __init__(self) -> None:
        self.epoch = 0  # odd while weights change
        self.version = None
        self.refs: dict[tuple[str, int], list[int]] = {}
        self.compared = 0
        self.mismatch: list[str] = []
        self.ends: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.hung = 0
        self.unexpected: list[str] = []
        self.stop = asyncio.Event()


async def stream_loop(s: S, c: httpx.AsyncClient, i: int) -> None:
    k = 0
    while not s.stop.is_set():
        p = (i + k) % len(PROMPTS)
        k += 1
        e0, v0 = s.epoch, s.version
        body = {
            "model": "tiny",
            "prompt": PROMPTS[p],
            "max_tokens": MAX_TOK,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,  # compared as ids: a partial UTF-8 text hides a change
        }
        toks: list[str] = []
        end = "no finish"

        async def one(body: dict[str, Any] = body, toks: list[str] = toks) -> str:
            nonlocal end
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    t = await r.aread()
                    s.codes[f"gen {r.status_code}"] += 1
                    if r.status_code >= 500:
                        s.unexpected.append(f"gen {r.status_code} {t[:200]!r}")
                    return f"http {r.status_code}"
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])
                        if "error" in ch:
                            return f"error {ch['error'].get('code')}"
                        toks.extend(map(str, ch["choices"][0].get("token_ids") or []))
                        f = ch["choices"][0].get("finish_reason")
                        if f:
                            end = str(f)
            return end

        try:
            end = await asyncio.wait_for(one(), STREAM_TIMEOUT)
        except TimeoutError:
            s.hung += 1
            end = "hung"
        except httpx.HTTPError as ex:
            end = f"exc {type(ex).__name__}"
        s.ends[end] += 1
        if end == "length" and s.epoch == e0 and e0 % 2 == 0 and s.version == v0:
            out = " ".join(toks)
            key = (str(v0), p)
            ref = s.refs.setdefault(key, out)
            s.compared += 1
            if out != ref:
                s.mismatch.append(f"{key}: {out!r} != {ref!r}")
        if end.startswith("http"):
            await asyncio.sleep(0.2)


async def call(
    s: S, c: httpx.AsyncClient, method: str, path: str, **kw: Any
) -> httpx.Response | None:
    t0 = time.monotonic()
    try:
        r = await asyncio.wait_for(c.request(method, path, **kw), CALL_TIMEOUT)
    except TimeoutError:
        s.hung += 1
        s.unexpected.append(f"{path} hung")
        return None
    except httpx.TransportError as e:  # the server closed the connection: never expected
        s.unexpected.append(f"{method} {path}: {type(e).__name__} {e}")
        return None
    dt = time.monotonic() - t0
    s.codes[f"{path.split('?')[0]} {r.status_code}"] += 1
    if r.status_code >= 500:
        s.unexpected.append(f"{method} {path} {r.status_code} {r.text[:300]} ({dt:.1f}s)")
    return r


async def reader_loop(s: S, c: httpx.AsyncClient) -> None:
    rng = random.Random(7)
    while not s.stop.is_set():
        if rng.random() < 0.5:
            await call(s, c, "GET", "/v1/status?fresh=true")
        else:
            await call(s, c, "GET", "/v1/is_paused")
        await asyncio.sleep(rng.uniform(0, 0.05))


async def raced(s: S, c: httpx.AsyncClient, path: str, cyc: int) -> None:
    """POST a sleep/wakeup while control reads race it; anything but 200 is recorded."""
    r, *_ = await asyncio.gather(
        call(s, c, "POST", path),
        call(s, c, "GET", "/v1/status?fresh=true"),
        call(s, c, "GET", "/v1/is_paused"),
    )
    if r is None or r.status_code != 200:
        what = path.split("?")[0].rsplit("/", 1)[1]
        got = None if r is None else (r.status_code, r.text[:200])
        s.unexpected.append(f"cycle {cyc} {what} {got}")


async def update(s: S, c: httpx.AsyncClient, v: str, what: str) -> None:
    """update_weights to v; the soak's expected version follows only a 200."""
    r = await call(s, c, "POST", "/v1/update_weights", json={"version": v})
    if r is not None and r.status_code == 200:
        s.version = v
    else:
        s.unexpected.append(f"{what} {None if r is None else r.text[:200]}")


async def status(c: httpx.AsyncClient) -> dict[str, Any]:
    r = await c.get("/v1/status?fresh=true", timeout=30)
    return r.json()


async def main(tp: int, cycles: int, time_box: float, tmp: Path, streams: int) -> int:
    env = {
        "ROLLBUS_SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE": "true",
        "ROLLBUS_NATS_PORT": "0",
        "ROLLBUS_CONTROL_TIMEOUT_S": "30",
        **json.loads(os.environ.get("SOAK_ENV", "{}")),
    }
    t_start = time.monotonic()
    stack = start_stack(tmp, None, tp=tp, env=env)
    print(f"stack up in {time.monotonic() - t_start:.0f}s at {stack.base_url}", flush=True)
    s = S()
    try:
        for v, seed in (("v1", 1), ("v2", 2)):
            d = tmp / f"src-{v}"
            if not (d / "config.json").exists():
                create_model_dir(d, None, seed=seed)
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    "publish",
                    str(d),
                    "--model",
                    "tiny",
                    "--version",
                    v,
                ],
                env=stack.env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            print(
                f"publish {v}: rc={r.returncode} {r.stdout.strip()[-120:]}",
                r.stderr.strip()[-300:],
                flush=True,
            )
            assert r.returncode == 0
        # uvicorn closes a connection idle for 5 s: a request sent on it just then is
        # "Server disconnected" (a client-side race); the pool drops idle ones first
        limits = httpx.Limits(max_connections=streams + 8, keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=None, limits=limits) as c:
            st = await status(c)
            s.version = st["weight_version"]
            pids0 = [rk["pid"] for rk in st["ranks"]]
            print("status0", s.version, st["state"], json.dumps(st["ranks"])[:600], flush=True)
            samples: list[tuple[int, list[tuple[int, int, int]]]] = []
            tasks = [asyncio.create_task(stream_loop(s, c, i)) for i in range(streams)]
            tasks.append(asyncio.create_task(reader_loop(s, c)))
            await asyncio.sleep(3)
            rng = random.Random(1)
            versions = ["v1", "v2"]
            nupd = 0
            cyc = 0
            durs = []
            while cyc < cycles and time.monotonic() - t_start < time_box:
                t0 = time.monotonic()
                mode = rng.choice(["keep", "abort", "wait"])
                await call(s, c, "POST", f"/v1/pause?mode={mode}")
                upd_asleep = cyc % 5 == 2
                # every 6th cycle by tags: weight (the group goes), then kv_cache
                split = cyc % 6 == 5
                # sleep races with control reads
                await raced(s, c, "/v1/sleep?tags=weight" if split else "/v1/sleep", cyc)
                if split:
                    await call(s, c, "POST", "/v1/sleep?tags=kv_cache")
                st = await status(c)
                cg = [rk.get("comm_group") for rk in st["ranks"]]
                if any(cg) or st["state"] != "sleeping":
                    s.unexpected.append(f"cycle {cyc} asleep: state={st['state']} comm_group={cg}")
                if upd_asleep:
                    v = versions[nupd % 2]
                    nupd += 1
                    s.epoch += 1
                    await update(s, c, v, f"cycle {cyc} update asleep")
                if split:  # the group comes back with the KV cache; the weights still sleep
                    await call(s, c, "POST", "/v1/wakeup?tags=kv_cache")
                    st = await status(c)
                    cg = [rk.get("comm_group") for rk in st["ranks"]]
                    if not all(cg) or st["state"] != "sleeping":
                        s.unexpected.append(
                            f"cycle {cyc} kv awake: state={st['state']} comm_group={cg}"
                        )
                await raced(s, c, "/v1/wakeup?tags=weight" if split else "/v1/wakeup", cyc)
                if upd_asleep:
                    s.epoch += 1
                st = await status(c)
                cg = [rk.get("comm_group") for rk in st["ranks"]]
                pids = [rk["pid"] for rk in st["ranks"]]
                if not all(cg) or st["state"] != "running" or st["weight_version"] != s.version:
                    s.unexpected.append(
                        f"cycle {cyc} awake: state={st['state']} comm_group={cg} "
                        f"v={st['weight_version']} want {s.version}"
                    )
                if pids != pids0:
                    s.unexpected.append(f"cycle {cyc} rank pids changed {pids0} -> {pids}")
                    pids0 = pids
                if cyc % 4 == 3:
                    v = versions[nupd % 2]
                    nupd += 1
                    await call(s, c, "POST", "/v1/pause?mode=keep")
                    s.epoch += 1
                    await update(s, c, v, f"cycle {cyc} update")
                    s.epoch += 1
                await call(s, c, "POST", "/v1/resume")
                await asyncio.sleep(rng.uniform(0.2, 1.0))  # let streams produce comparable outputs
                cyc += 1
                durs.append(time.monotonic() - t0)
                if cyc == 1 or cyc % 10 == 0:
                    samples.append((cyc, [proc_stats(p) for p in pids]))
                    print(
                        f"cycle {cyc} t={time.monotonic() - t_start:.0f}s v={s.version} "
                        f"compared={s.compared} mismatch={len(s.mismatch)} "
                        f"unexpected={len(s.unexpected)} ends={dict(s.ends)} "
                        f"ranks(fd,thr,rssKB)={samples[-1][1]}",
                        flush=True,
                    )
            await asyncio.sleep(5)
            s.stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT + 10)
            samples.append((cyc, [proc_stats(p) for p in pids0]))
            st = await status(c)
        log = stack.log.read_text(errors="replace")
        restarts = [ln for ln in log.splitlines() if "restart" in ln.lower()]
        print(
            f"\n== TP={tp} cycles={cyc} in {time.monotonic() - t_start:.0f}s, cycle mean "
            f"{sum(durs) / max(1, len(durs)):.1f}s max {max(durs, default=0):.1f}s"
        )
        print(
            f"updates={nupd} streams={sum(s.ends.values())} ends={dict(s.ends)} "
            f"compared={s.compared} refs={len(s.refs)}"
        )
        print(f"mismatches={len(s.mismatch)} {s.mismatch[:5]}")
        print(f"hung={s.hung} codes={dict(s.codes)}")
        print(f"unexpected={len(s.unexpected)} {s.unexpected[:10]}")
        print(f"log restart lines={restarts[:5]}")
        (c1, a), (cn, b) = samples[0], samples[-1]
        for r_, (x, y) in enumerate(zip(a, b, strict=True)):
            n = max(1, cn - c1)
            print(
                f"rank {r_}: cycle {c1}->{cn}: fds {x[0]}->{y[0]} ({(y[0] - x[0]) / n:+.2f}/cycle) "
                f"threads {x[1]}->{y[1]} ({(y[1] - x[1]) / n:+.2f}/cycle) "
                f"rss {x[2] // 1024}->{y[2] // 1024} MiB ({(y[2] - x[2]) / n:+.0f} KiB/cycle)"
            )
        print("samples", samples)
        print("refs", {f"{k[0]}/p{k[1]}": v for k, v in sorted(s.refs.items())})
        print(
            "final status",
            st["state"],
            st["weight_version"],
            [(rk["pid"], rk.get("comm_group"), rk.get("alive")) for rk in st["ranks"]],
        )
        return 0
    finally:
        rc = stack.stop()
        print("stack stopped rc", rc)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--time-box", type=float, default=900.0, help="seconds, stack start included")
    ap.add_argument("--streams", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="comm-soak-") as d:
        sys.exit(asyncio.run(main(a.tp, a.cycles, a.time_box, Path(d), a.streams)))
