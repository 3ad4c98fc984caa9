"""Checkpoint distribution: a ~520 MiB fp32 checkpoint at TP=2.

Measured in one run, against baselines from the same run:

* raw core NATS: 1 MiB publish→subscribe between two nats-py processes (credit-bounded
  to 32 MiB in flight, as any reader must be), MiB/s;
* stock nats-py ``ObjectStore.get`` of a 32 MiB object (its rate does not depend on the
  size; a full shard would take minutes);
* our object-store pull, per rank (``pull_mib_s`` reported by each rank while both pull
  at once), without and with SHA-256 verification, and the whole pause→update→resume;
* the ipc path (map the shm shard, parse, copy into paddle tensors: what a rank's stage
  does) beside a raw memcpy of the same bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import nats
import numpy as np

from shared import objstore
from tests.e2e.stack import start_stack

MIB = 1 << 20
CONFIG = {  # 2 layers × 51.4 M + 2 × 16.8 M params (embed, lm_head) ≈ 520 MiB fp32
    "vocab_size": 8192,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}


def raw_core_nats(url: str, n: int = 512, runs: int = 3, flows: int = 1) -> list[float]:
    """MiB/s of each of ``flows`` concurrent publisher→subscriber pairs, over ``runs``."""
    out = []
    for _ in range(runs):
        subs, pubs = [], []
        for _ in range(flows):
            subj = f"bench.pipe.{uuid.uuid4().hex}"
            sub = subprocess.Popen(
                [sys.executable, "-m", "tests.bench.rawpipe", "sub", url, subj, str(n)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert sub.stdout is not None
            sub.stdout.readline()
            subs.append((sub, subj))
        for _, subj in subs:
            pubs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.bench.rawpipe", "pub", url, subj, str(n)]
                )
            )
        for sub, _ in subs:
            assert sub.stdout is not None
            out.append(float(sub.stdout.readline()))
            sub.wait()
        for p in pubs:
            p.wait()
    return out


async def stock_get(url: str, runs: int = 2) -> list[float]:
    nc = await nats.connect(url)
    try:
        await objstore.ensure_bucket(nc, "rollbus_bench")
        await objstore.put_object(nc, "rollbus_bench", "stock", os.urandom(32 * MIB))
        store = await nc.jetstream().object_store("rollbus_bench")
        out = []
        for _ in range(runs):
            t0 = time.perf_counter()
            r = await store.get("stock")
            out.append(len(r.data) / MIB / (time.perf_counter() - t0))
        return out
    finally:
        await nc.close()


def ipc_vs_memcpy(model: str, runs: int = 3) -> tuple[list[float], list[float], int]:
    """Rank 0's ipc stage work vs one memcpy of its shard's bytes, in seconds."""
    from services.tiny_model import TINY_CONFIG
    from services.trainer.publisher import CheckpointPublisher
    from services.worker import model as mdl
    from services.worker.sources import IpcSource
    from services.worker.weights import to_paddle
    from shared.settings import Settings

    ipc_dir = Path("/dev/shm/rollbus-bench")
    cfg_d = {**TINY_CONFIG, **CONFIG}
    pub = CheckpointPublisher("nats://unused", ipc_dir=ipc_dir)
    blobs, man = pub.prepare(
        model, "ipc1", mdl.init_weights(mdl.ModelConfig.from_hf(cfg_d), 7), 2, cfg_d
    )
    pub._write_ipc(model, "ipc1", blobs, man, None)
    del blobs
    settings = Settings(model="/nonexistent", model_name=model, tp=2, ipc_dir=ipc_dir)
    src = IpcSource(settings, None, 0, 2)  # type: ignore[arg-type]
    ipc_s, copy_s = [], []
    try:
        raw = np.frombuffer((ipc_dir / model / "ipc1" / man.shards[0].file).read_bytes(), np.uint8)
        for _ in range(runs):
            t0 = time.perf_counter()
            tensors = to_paddle(src("ipc1", False).arrays)
            ipc_s.append(time.perf_counter() - t0)
            del tensors
            t0 = time.perf_counter()
            b = raw.copy()  # the baseline: one memcpy of the same bytes into fresh memory
            copy_s.append(time.perf_counter() - t0)
            del b
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    return ipc_s, copy_s, man.shards[0].size


async def single_reader(url: str, name: str, sha: str, runs: int = 3) -> dict[bool, list[float]]:
    """Our reader alone (one flow, like the raw baseline), MiB/s, without/with verify."""
    nc = await nats.connect(url)
    out: dict[bool, list[float]] = {False: [], True: []}
    try:
        for verify in (False, True):
            for _ in range(runs):
                t0 = time.perf_counter()
                buf = await objstore.read_object(
                    nc, "rollbus_ckpt", name, expect_sha256=sha if verify else None
                )
                out[verify].append(len(buf) / MIB / (time.perf_counter() - t0))
                del buf
    finally:
        await nc.close()
    return out


def run(tmp: Path, nats_url: str, cycles: int = 3) -> str:
    from services.trainer import names
    from services.trainer.publisher import CheckpointPublisher
    from services.worker import model as mdl

    stack = start_stack(
        tmp / "ckpt",
        nats_url,
        tp=2,
        model_config=CONFIG,
        model_name=f"bench-{uuid.uuid4().hex[:6]}",
        env={
            "ROLLBUS_LOAD_STRATEGY": "object_store",
            "ROLLBUS_CONTROL_TIMEOUT_S": "300",
            "ROLLBUS_KV_CACHE_BLOCKS": "8",
        },
    )
    model = stack.model_dir.name
    try:
        cfg_d = json.loads((stack.model_dir / "config.json").read_text())
        cfg = mdl.ModelConfig.from_hf(cfg_d)
        pub = CheckpointPublisher(nats_url)
        pub_rates = []
        for i, v in enumerate(("p1", "p2")):
            state = names.to_training(mdl.init_weights(cfg, 100 + i), cfg)
            res = pub.publish(model, v, state, tp=2, config=cfg_d)
            pub_rates.append(res.mib_s)
            total = res.bytes
            del state
        raw = raw_core_nats(nats_url)
        raw2 = raw_core_nats(nats_url, n=256, flows=2)
        from shared import manifest as mf

        async def shard0() -> tuple[str, str]:
            nc = await nats.connect(nats_url)
            try:
                m = mf.decode(
                    bytes(
                        await objstore.read_object(nc, "rollbus_ckpt", f"{model}/p1/manifest.json")
                    )
                )
            finally:
                await nc.close()
            return f"{model}/p1/{m.shards[0].file}", m.shards[0].sha256

        single = asyncio.run(single_reader(nats_url, *asyncio.run(shard0())))
        stock = asyncio.run(stock_get(nats_url))
        pulls: dict[bool, list[float]] = {False: [], True: []}
        cycle_s: dict[bool, list[float]] = {False: [], True: []}
        with httpx.Client(base_url=stack.base_url, timeout=600) as c:
            k = 0
            for verify in (False, True):
                for _ in range(cycles):
                    v = ("p1", "p2")[k % 2]
                    k += 1
                    t0 = time.perf_counter()
                    assert c.post("/v1/pause").status_code == 200
                    r = c.post("/v1/update_weights", json={"version": v, "verify_checksum": verify})
                    assert r.status_code == 200, r.text
                    assert c.post("/v1/resume").status_code == 200
                    cycle_s[verify].append(time.perf_counter() - t0)
                    pulls[verify] += [x["pull_mib_s"] for x in r.json()["result"]["ranks"]]
    finally:
        stack.stop()
    ipc_s, copy_s, shard_size = ipc_vs_memcpy(f"bench-ipc-{uuid.uuid4().hex[:6]}")

    raw50, stock50 = statistics.median(raw), statistics.median(stock)
    raw2_50 = statistics.median(raw2)
    rows = [
        f"| raw core NATS 1 MiB pub→sub (2 nats-py processes) | {raw50:.0f} | 1.00× | |",
        f"| raw core NATS, 2 such flows at once, per flow | {raw2_50:.0f} | "
        f"{raw2_50 / raw50:.2f}× | the per-rank baseline |",
        f"| stock nats-py ObjectStore.get (32 MiB) | {stock50:.1f} | {stock50 / raw50:.2f}× | |",
    ]
    for verify in (False, True):
        p = statistics.median(single[verify])
        label = "with" if verify else "without"
        rows.append(
            f"| rollbus reader alone (one flow, like raw), {label} verify | {p:.0f} | "
            f"{p / raw50:.2f}× | {p / stock50:.0f}× stock get |"
        )
    for verify in (False, True):
        p = statistics.median(pulls[verify])
        label = "with" if verify else "without"
        rows.append(
            f"| update_weights: both ranks at once, sum of per-rank, {label} verify | {2 * p:.0f} "
            f"| {2 * p / raw50:.2f}× | {2 * p / stock50:.0f}× stock get |"
        )
        rows.append(
            f"| rollbus pull per rank, both ranks at once, {label} verify | {p:.0f} | "
            f"{p / raw50:.2f}× | {p / raw2_50:.2f}× raw per flow; {p / stock50:.0f}× stock get |"
        )
    rows.append(
        f"| SDK publish (2 shards, {total / MIB:.0f} MiB) | {statistics.median(pub_rates):.0f} "
        f"| {statistics.median(pub_rates) / raw50:.2f}× | |"
    )
    ipc50, copy50 = statistics.median(ipc_s), statistics.median(copy_s)
    out = [
        f"\n### Checkpoint distribution, {total / MIB:.0f} MiB fp32 checkpoint at TP=2 "
        f"(hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, "
        f"vocab {CONFIG['vocab_size']}), medians\n",
        "| path | MiB/s | / raw core NATS | note |",
        "|---|---|---|---|",
        *rows,
        "",
        "| cycle | seconds (median) |",
        "|---|---|",
        f"| pause → update_weights → resume, no verify | {statistics.median(cycle_s[False]):.2f} |",
        f"| pause → update_weights → resume, verify | {statistics.median(cycle_s[True]):.2f} |",
        "",
        f"| ipc, rank 0 shard {shard_size / MIB:.0f} MiB | seconds | / memcpy |",
        "|---|---|---|",
        f"| memcpy of the same bytes (baseline) | {copy50:.3f} | 1.00× |",
        f"| ipc stage: mmap + parse + one copy, handed to paddle | {ipc50:.3f} | "
        f"{ipc50 / copy50:.2f}× |",
    ]
    return "\n".join(out)
