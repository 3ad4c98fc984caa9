"""Checkpoint distribution: publish and pull of a 648 MiB fp32 checkpoint at TP=2.

Every figure is against a baseline measured in the same run, like with like:

* **publish**: raw JetStream publish of the same number of bytes (nats-py, 1 MiB
  messages, the same window of unacknowledged publishes as ours) vs the SDK publishing
  a training state dict (names mapped, transposed, sharded, serialized, hashed,
  uploaded, announced: everything a trainer waits for) and ``rollbus publish`` of the
  served HF model dir (its own reported rate; its wall time incl. Python start in the
  seconds table). Target >= 0.8×;
* **pull, one flow**: raw core NATS, one publisher process → one subscriber process
  (1 MiB messages, credit-bounded), vs our reader alone in its own process, without /
  with SHA-256 (targets >= 1.0× / >= 0.9×), our reader's nats-py fallback (no target),
  and stock nats-py ``ObjectStore.get`` of the same object in every run (it concatenates
  chunks, so it slows with size: ≈ 40 s per run at full size) with its ``writeinto``
  path; each rank's own pull during ``update_weights`` (both ranks at once) against each
  of two raw flows at once (like with like: two pulls sharing the machine), no target;
  the client process's and nats-server's CPU seconds per GiB of the single flows;
* **pull, aggregate**: R raw flows at once vs R of our pullers at once (one per rank's
  shard), each as total bytes / wall time from the first start to the last end, and vs
  the ranks' own pulls during ``update_weights`` (both shards / the slowest rank's pull
  time). Targets >= 1.0× / >= 0.9× (SHA-256);
* **ipc**: rank 0's ipc stage work vs a memcpy of the same bytes (target <= 2×).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
from nats.js.errors import NotFoundError

from shared import manifest as mf
from shared import objstore, sharding
from shared.model_config import ModelConfig
from tests.bench.common import Table, start_stack_retry

log = logging.getLogger("bench")
MIB = 1 << 20
BUCKET = "rollbus_ckpt"
CONFIG = {  # ≈ 520 MiB of parameters; 648 MiB of shards at tp=2 (embed/lm_head replicated)
    "vocab_size": 8192,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}
QUICK = {  # ≈ 40 MiB: checks the method, not the numbers
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}


# --------------------------------------------------------------------------- helpers


def _json_line(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    try:
        out = dict(json.loads(line))
    except ValueError:
        raise RuntimeError(f"{p.args}: no result ({line!r})") from None
    if "error" in out:
        raise RuntimeError(f"{p.args}: {out['error']}")
    return out


def _aggregate(results: list[dict[str, Any]]) -> float:
    """Total MiB / wall time from the first start to the last end (MiB/s)."""
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    return sum(r["bytes"] for r in results) / MIB / max(wall, 1e-9)


def _retry(fn: Any, *args: Any, attempts: int = 3) -> Any:
    """``fn(*args)``, run again (logged) when it fails: a raw flow that loses messages or a
    pull cut short happen now and then on a loaded machine; the failure is never measured."""
    for i in range(1, attempts + 1):
        try:
            return fn(*args)
        except RuntimeError as e:
            if i == attempts:
                raise
            log.warning("%s failed (%s); again (%d/%d)", fn.__name__, e, i, attempts)
    raise AssertionError("unreachable")


def raw_flows(url: str, mib: int, flows: int) -> list[dict[str, Any]]:
    """``flows`` raw core-NATS publisher→subscriber process pairs at once (retried)."""
    return list(_retry(_raw_flows, url, mib, flows))


def _raw_flows(url: str, mib: int, flows: int) -> list[dict[str, Any]]:
    subs = []
    for _ in range(flows):
        subj = f"bench.pipe.{uuid.uuid4().hex}"
        sub = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.rawpipe", "sub", url, subj, str(mib)],
            stdout=subprocess.PIPE, text=True,
        )
        assert sub.stdout is not None
        sub.stdout.readline()
        subs.append((sub, subj))
    pubs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.bench.rawpipe", "pub", url, subj, str(mib), "--wait"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for _, subj in subs
    ]
    for p in pubs:  # every publisher connected before any starts: the flows overlap fully
        assert p.stdout is not None
        p.stdout.readline()
    for p in pubs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    try:
        return [_json_line(s) for s, _ in subs]
    finally:
        for p in [*(s for s, _ in subs), *pubs]:
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def pullers(url: str, objects: list[tuple[str, str | None]], timeout: float = 300,
            extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One :mod:`tests.bench.puller` process per (object, sha/"stock"/None), started
    together once all are connected (retried); ``extra``: more puller arguments."""
    return list(_retry(_pullers, url, objects, timeout, extra))


def _pullers(url: str, objects: list[tuple[str, str | None]], timeout: float,
             extra: tuple[str, ...]) -> list[dict[str, Any]]:
    procs = []
    for name, sha in objects:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.bench.puller", url, BUCKET, name,
             *([sha] if sha else []), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        ))
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{p.args} did not start")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        out = [_json_line(p) for p in procs]
        for p in procs:
            p.wait(timeout)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


RAW_STREAM, RAW_SUBJECT = "BENCH_RAW_PUB", "bench.rawpub.data"


async def _raw_stream(js: Any) -> None:
    """The raw baseline's stream, made afresh (empty, as the bucket's chunk subject is
    new) with exactly the checkpoint bucket's stream configuration (storage, replicas,
    limits, discard policy, direct get, rollup headers: the same server-side work per
    message); only its name and subject differ."""
    cfg = (await js.stream_info(f"OBJ_{BUCKET}")).config
    cfg.name, cfg.subjects = RAW_STREAM, [RAW_SUBJECT]
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(RAW_STREAM)
    await js.add_stream(cfg)


async def raw_js_publish(url: str, blobs: list[Any] | int) -> float:
    """MiB/s of a plain nats-py JetStream publish, 1 MiB messages, at most
    :data:`objstore.PUT_WINDOW` unacknowledged, into a stream set up as the bucket's
    (:func:`_raw_stream`). ``blobs``: the bytes to send (each split into 1 MiB messages,
    the last one of each shorter, as ours: the very bytes the SDK publishes); an int:
    that many bytes as one random 1 MiB buffer sent again and again (the earlier
    baseline). Timed from the first publish to the last ack."""
    if isinstance(blobs, int):
        one = memoryview(os.urandom(MIB))
        msgs = [one] * max(1, blobs // MIB)
    else:
        msgs = [memoryview(b).cast("B")[a : a + MIB] for b in blobs
                for a in range(0, len(b), MIB)]
    nc = await nats.connect(url, pending_size=256 * MIB)
    js = nc.jetstream()
    try:
        await _raw_stream(js)
        n = len(msgs)
        window = asyncio.Semaphore(objstore.PUT_WINDOW)
        done = asyncio.get_running_loop().create_future()
        acked = [0]
        inbox = nc.new_inbox()

        async def on_ack(msg: Any) -> None:
            window.release()
            acked[0] += 1
            if acked[0] == n and not done.done():
                done.set_result(None)

        await nc.subscribe(inbox + ".*", cb=on_ack)
        await nc.flush()
        t0 = time.perf_counter()
        for i, m in enumerate(msgs):
            await window.acquire()
            await nc.publish(RAW_SUBJECT, m, reply=f"{inbox}.{i}")  # type: ignore[arg-type]
        await asyncio.wait_for(done, 120)
        rate = sum(len(m) for m in msgs) / MIB / (time.perf_counter() - t0)
        await js.purge_stream(RAW_STREAM)
        return rate
    finally:
        await nc.close()


async def _drop_version(url: str, model: str, version: str) -> None:
    """Free the disk a benchmark version took (its chunks and metas)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for f in ("manifest.json", "rank0-of-2.safetensors", "rank1-of-2.safetensors"):
            name = f"{model}/{version}/{f}"
            try:
                meta = await objstore.get_meta(nc, BUCKET, name)
            except objstore.ObjectMissing:
                continue
            await js.purge_stream(f"OBJ_{BUCKET}", subject=f"$O.{BUCKET}.C.{meta.nuid}")
            await js.purge_stream(f"OBJ_{BUCKET}", subject=objstore._meta_subject(BUCKET, name))
    finally:
        await nc.close()


async def _shards(url: str, model: str, version: str) -> list[tuple[str, str, int]]:
    nc = await nats.connect(url)
    try:
        raw = await objstore.read_object(nc, BUCKET, f"{model}/{version}/manifest.json")
        m = mf.decode(bytes(raw))
    finally:
        await nc.close()
    return [(f"{model}/{version}/{s.file}", s.sha256, s.size) for s in m.shards]


def cli_publish(url: str, model_dir: Path, model: str, version: str) -> tuple[float, float]:
    """(reported MiB/s, wall seconds incl. Python start) of ``rollbus publish``."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "publish", str(model_dir), "--model", model,
         "--version", version, "--tp", "2", "--nats-url", url],
        capture_output=True, text=True, timeout=600,
    )
    wall = time.perf_counter() - t0
    m = re.search(r"([\d.]+) MiB/s\)", r.stdout)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"rollbus publish failed: {r.stdout[-500:]} {r.stderr[-1500:]}")
    return float(m.group(1)), wall


def ipc_vs_memcpy(
    model: str, cfg_over: dict[str, Any], runs: int
) -> tuple[list[float], list[float], int]:
    """Rank 0's ipc stage work vs one memcpy of its shard's bytes, in seconds."""
    from services.tiny_model import TINY_CONFIG
    from services.trainer.publisher import CheckpointPublisher
    from services.worker.sources import IpcSource
    from services.worker.weights import to_paddle
    from shared.settings import Settings

    ipc_dir = Path(f"/dev/shm/rollbus-bench-{os.getpid()}")
    cfg_d = {**TINY_CONFIG, **cfg_over}
    pub = CheckpointPublisher("nats://unused", ipc_dir=ipc_dir)
    blobs, man = pub.prepare(
        model, "ipc1", sharding.init_weights(ModelConfig.from_hf(cfg_d), 7), 2, cfg_d
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


# --------------------------------------------------------------------------- publish


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_pid(pid: int | None) -> float:
    """CPU seconds (user + system) of process ``pid`` so far (0 when not known)."""
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def publish_round(res: dict[str, list[float]], nats_url: str, nats_pid: int | None, pub: Any,
                  model: str, tag: str, state: Any, cfg_d: dict[str, Any], blobs: list[Any],
                  model_dir: Path) -> None:
    """One run of the publish rows, interleaved: raw JetStream publish of the very bytes
    the SDK publishes, the SDK publish of ``state``, ``rollbus publish`` of ``model_dir``,
    and the raw publish of one 1 MiB buffer sent again and again (the earlier baseline).
    Client CPU (this process, all threads) and server CPU per GiB of the first two."""
    gib = sum(len(b) for b in blobs) / (1 << 30)

    def put(key: str, v: float) -> None:
        res.setdefault(key, []).append(v)

    def metered(key: str, fn: Any) -> Any:
        c0, s0 = _cpu_self(), _cpu_pid(nats_pid)
        out = fn()
        put(f"{key}_cpu", (_cpu_self() - c0) / gib)
        put(f"{key}_srv", (_cpu_pid(nats_pid) - s0) / gib)
        return out

    put("raw_js", metered("raw", lambda: asyncio.run(raw_js_publish(nats_url, blobs))))
    r = metered("sdk", lambda: pub.publish(model, f"s{tag}", state, tp=2, config=cfg_d))
    put("sdk", r.mib_s)
    asyncio.run(_drop_version(nats_url, model, f"s{tag}"))
    rate, wall = cli_publish(nats_url, model_dir, model, f"c{tag}")
    put("cli", rate)
    put("cli_wall", wall)
    asyncio.run(_drop_version(nats_url, model, f"c{tag}"))
    put("raw_one", asyncio.run(raw_js_publish(nats_url, sum(len(b) for b in blobs))))


def publish_tables(res: dict[str, list[float]], head: str, cpu: bool) -> list[Table]:
    pub_t = Table("publish", f"Checkpoint publish, {head}: MiB/s", "MiB/s")
    pub_t.add("raw JetStream publish of the same bytes (nats-py, 1 MiB, window "
              f"{objstore.PUT_WINDOW}, a stream configured as the bucket's)",
              values=res["raw_js"])
    base = pub_t.rows[0].name
    pub_t.add("SDK publish of a training state dict (map, shard, serialize, hash, upload, "
              "announce)", values=res["sdk"], baseline=base, target=(">=", 0.8))
    pub_t.add("`rollbus publish` of the HF model dir (its reported rate)",
              values=res["cli"], baseline=base, target=(">=", 0.8))
    pub_t.add("raw JetStream publish, one random 1 MiB buffer sent again and again "
              "(the earlier baseline; no target)", values=res["raw_one"], baseline=base)
    if not cpu:
        return [pub_t]
    cpu_t = Table("publish_cpu", f"Checkpoint publish CPU, {head}: seconds per GiB "
                  "(robust on a busy machine)", "s/GiB")
    cpu_t.add("raw JetStream publish: client process", values=res["raw_cpu"])
    cpu_t.add("SDK publish: client process (all threads)", values=res["sdk_cpu"],
              baseline=cpu_t.rows[0].name)
    cpu_t.add("raw JetStream publish: nats-server", values=res["raw_srv"])
    cpu_t.add("SDK publish: nats-server", values=res["sdk_srv"], baseline=cpu_t.rows[2].name)
    return [pub_t, cpu_t]


def run_publish(tmp: Path, nats_url: str, runs: int = 5, quick: bool = False,
                nats_pid: int | None = None) -> list[Table]:
    """``python -m tests.bench publish``: the publish rows alone, without a stack (the
    same checkpoint, state dict and model dir as the checkpoint part), and their CPU."""
    from services.tiny_model import create_model_dir
    from services.trainer import names
    from services.trainer.publisher import CheckpointPublisher

    over = QUICK if quick else CONFIG
    model = f"bench-{uuid.uuid4().hex[:6]}"
    model_dir = create_model_dir(tmp / "publish" / model, over, seed=0)
    cfg_d = json.loads((model_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf(cfg_d)
    pub = CheckpointPublisher(nats_url)
    state = names.to_training(sharding.init_weights(cfg, 5), cfg)  # what a trainer holds
    r = pub.publish(model, "w0", state, tp=2, config=cfg_d)  # rings kept, as a trainer's
    asyncio.run(_drop_version(nats_url, model, "w0"))
    blobs, _ = pub.prepare(model, "raw", state, 2, cfg_d)  # the bytes the SDK publishes
    res: dict[str, list[float]] = {}
    for run_i in range(runs):
        publish_round(res, nats_url, nats_pid, pub, model, str(run_i), state, cfg_d, blobs,
                      model_dir)
        log.info("publish run %d/%d done", run_i + 1, runs)
    size = f"hidden {over['hidden_size']}, {over['num_hidden_layers']} layers, " \
        f"vocab {over['vocab_size']}"
    return publish_tables(res, f"{r.bytes / MIB:.0f} MiB fp32 checkpoint at TP=2 ({size})",
                          nats_pid is not None)


# --------------------------------------------------------------------------- pull


def pull_round(res: dict[str, list[float]], nats_url: str, shard_mib: int,
               shard_objs: list[tuple[str, str, int]], nats_pid: int | None = None) -> None:
    """One run of the pull rows, interleaved: one raw flow, our reader alone (without /
    with SHA-256, through nats-py), stock ``ObjectStore.get`` (plain: it concatenates the
    chunks, ≈ 40 s at 324 MiB; and its linear ``writeinto`` path), then two raw flows at
    once and two of our pullers at once. Every row gets one value per run; the single
    flows' client CPU (and, given ``nats_pid``, nats-server's) per GiB too."""

    def put(key: str, v: float) -> None:
        res.setdefault(key, []).append(v)

    def metered(key: str, fn: Any, *args: Any) -> dict[str, Any]:
        s0 = _cpu_pid(nats_pid)
        out = fn(*args)[0]
        gib = out["bytes"] / (1 << 30)
        put(f"{key}_cpu", out["cpu_s"] / gib)
        if nats_pid:
            put(f"{key}_srv", (_cpu_pid(nats_pid) - s0) / gib)
        return dict(out)

    name0, sha0, _ = shard_objs[0]
    put("raw1", metered("raw1", raw_flows, nats_url, shard_mib, 1)["mib_s"])
    put("ours1", metered("ours1", pullers, nats_url, [(name0, None)])["mib_s"])
    put("ours1_sha", metered("ours1_sha", pullers, nats_url, [(name0, sha0)])["mib_s"])
    put("ours1_py", pullers(nats_url, [(name0, None)], extra=("--nats-py",))[0]["mib_s"])
    put("stock", pullers(nats_url, [(name0, "stock")], 900)[0]["mib_s"])
    put("stock_into", pullers(nats_url, [(name0, "stock-into")], 900)[0]["mib_s"])
    # pull, aggregate of both ranks' shards at once; and the rate of each of the two
    # raw flows (what each of two ranks pulling at once is compared to)
    flows = raw_flows(nats_url, shard_mib, 2)
    put("raw2", _aggregate(flows))
    put("raw2_flow", statistics.median(f["mib_s"] for f in flows))
    put("ours2", _aggregate(pullers(nats_url, [(n, None) for n, _, _ in shard_objs])))
    put("ours2_sha", _aggregate(pullers(nats_url, [(n, s) for n, s, _ in shard_objs])))


def pull_tables(res: dict[str, list[float]], shard_mib: int, total_mib: float) -> list[Table]:
    """The single-flow and the aggregate pull tables, and the single flows' CPU.

    Targets (issue 10), each on like against like: a single pull (our reader alone, its
    own process) against one raw flow alone; R pulls at once (R pullers, or the R ranks
    during ``update_weights``) against R raw flows at once, as total MiB / wall time. A
    rank's own pull during ``update_weights`` runs beside the other rank's: it is shown
    against the rate of each of two raw flows at once, without a target (what both do
    together carries the aggregate target)."""
    one = Table("pull_one", f"Checkpoint pull, one flow, shard of {shard_mib} MiB: MiB/s",
                "MiB/s")
    one.add("raw core NATS, 1 publisher → 1 subscriber process", values=res["raw1"])
    b1 = one.rows[0].name
    one.add("rollbus reader alone (own process)", values=res["ours1"], baseline=b1,
            target=(">=", 1.0))
    one.add("rollbus reader alone, SHA-256 verified", values=res["ours1_sha"], baseline=b1,
            target=(">=", 0.9))
    one.add("rollbus reader through nats-py (its fallback: no second connection)",
            values=res["ours1_py"], baseline=b1)
    one.add("stock nats-py ObjectStore.get, same object (concatenates chunks: slows with "
            "size)", values=res["stock"], baseline=b1)
    one.add("stock nats-py ObjectStore.get(writeinto=BytesIO), same object",
            values=res["stock_into"], baseline=b1)
    one.add("raw core NATS, each of 2 flows at once (median of the two)",
            values=res["raw2_flow"])
    b1x2 = one.rows[-1].name
    one.add("per rank during update_weights (both ranks at once), no verify",
            values=res["rank_False"], baseline=b1x2)
    one.add("per rank during update_weights (both ranks at once), verify",
            values=res["rank_True"], baseline=b1x2)

    agg = Table("pull_aggregate",
                f"Checkpoint pull, aggregate of both ranks' shards at once ({total_mib:.0f} "
                "MiB): total MiB / wall time, MiB/s", "MiB/s")
    agg.add("raw core NATS, 2 flows at once", values=res["raw2"])
    b2 = agg.rows[0].name
    agg.add("rollbus, 2 pullers at once (own processes)", values=res["ours2"], baseline=b2,
            target=(">=", 1.0))
    agg.add("rollbus, 2 pullers at once, SHA-256 verified", values=res["ours2_sha"],
            baseline=b2, target=(">=", 0.9))
    agg.add("ranks during update_weights: both shards / the slowest rank's pull, no verify",
            values=res["ranks_agg_False"], baseline=b2, target=(">=", 1.0))
    agg.add("ranks during update_weights: both shards / the slowest rank's pull, verify",
            values=res["ranks_agg_True"], baseline=b2, target=(">=", 0.9))
    agg.add("update_weights stage (pull + parse + to paddle), no verify",
            values=res["stage_False"], baseline=b2)
    agg.add("update_weights stage, verify", values=res["stage_True"], baseline=b2)

    cpu = Table("pull_cpu", f"Checkpoint pull CPU, one flow, shard of {shard_mib} MiB: "
                "seconds per GiB (robust on a busy machine)", "s/GiB")
    cpu.add("raw core NATS: subscriber process", values=res["raw1_cpu"])
    cpu.add("rollbus reader alone: reader process (all threads)", values=res["ours1_cpu"],
            baseline=cpu.rows[0].name)
    cpu.add("rollbus reader alone, SHA-256 verified: reader process (all threads)",
            values=res["ours1_sha_cpu"], baseline=cpu.rows[0].name)
    if res.get("raw1_srv"):
        cpu.add("raw core NATS: nats-server", values=res["raw1_srv"])
        base = cpu.rows[-1].name
        cpu.add("rollbus reader alone: nats-server", values=res["ours1_srv"], baseline=base)
        cpu.add("rollbus reader alone, SHA-256 verified: nats-server",
                values=res["ours1_sha_srv"], baseline=base)
    return [one, agg, cpu]


# --------------------------------------------------------------------------- run


def run(tmp: Path, nats_url: str, runs: int = 5, quick: bool = False,
        nats_pid: int | None = None) -> list[Table]:
    from services.trainer import names
    from services.trainer.publisher import CheckpointPublisher

    over = QUICK if quick else CONFIG
    stack = start_stack_retry(
        tmp / "ckpt",
        nats_url,
        tp=2,
        model_config=over,
        model_name=f"bench-{uuid.uuid4().hex[:6]}",
        env={
            "ROLLBUS_LOAD_STRATEGY": "object_store",
            "ROLLBUS_CONTROL_TIMEOUT_S": "300",
            "ROLLBUS_KV_CACHE_BLOCKS": "8",
        },
    )
    model = stack.model_dir.name
    cfg_d = json.loads((stack.model_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf(cfg_d)
    pub = CheckpointPublisher(nats_url)
    size = f"hidden {over['hidden_size']}, {over['num_hidden_layers']} layers, " \
        f"vocab {over['vocab_size']}"
    res: dict[str, list[float]] = {}

    def put(key: str, v: float) -> None:
        res.setdefault(key, []).append(v)

    try:
        for i, v in enumerate(("p1", "p2")):  # the versions the ranks pull
            r = pub.publish(model, v, sharding.init_weights(cfg, 100 + i), tp=2, config=cfg_d)
            total = r.bytes
        shard_objs = asyncio.run(_shards(nats_url, model, "p1"))
        shard_mib = shard_objs[0][2] // MIB
        state = names.to_training(sharding.init_weights(cfg, 5), cfg)  # what a trainer holds
        blobs, _ = pub.prepare(model, "raw", state, 2, cfg_d)  # the bytes the SDK publishes
        with httpx.Client(base_url=stack.base_url, timeout=600) as c:
            for run_i in range(runs):
                publish_round(res, nats_url, nats_pid, pub, model, str(run_i), state, cfg_d,
                              blobs, stack.model_dir)
                pull_round(res, nats_url, shard_mib, shard_objs, nats_pid)
                # the whole cycle through the stack, without and with verification
                for verify in (False, True):
                    t0 = time.perf_counter()
                    assert c.post("/v1/pause").status_code == 200
                    ver = ("p1", "p2")[(2 * run_i + verify) % 2]
                    rr = c.post("/v1/update_weights",
                                json={"version": ver, "verify_checksum": verify})
                    assert rr.status_code == 200, rr.text
                    assert c.post("/v1/resume").status_code == 200
                    put(f"cycle_{verify}", time.perf_counter() - t0)
                    body = rr.json()["result"]
                    put(f"rank_{verify}",
                        statistics.median(x["pull_mib_s"] for x in body["ranks"]))
                    # the ranks' aggregate: both shards' bytes / the slowest rank's pull
                    put(f"ranks_agg_{verify}", sum(x["bytes"] for x in body["ranks"]) / MIB
                        / max(x["pull_s"] for x in body["ranks"]))
                    put(f"stage_{verify}", body["bytes"] / MIB / body["stage_s"])
                log.info("checkpoint run %d/%d done", run_i + 1, runs)
    finally:
        stack.stop()
    ipc, copy, ipc_size = ipc_vs_memcpy(f"bench-ipc-{uuid.uuid4().hex[:6]}", over, runs)

    head = f"{total / MIB:.0f} MiB fp32 checkpoint at TP=2 ({size})"
    pub_ts = publish_tables(res, head, nats_pid is not None)

    pull_ts = pull_tables(res, shard_mib, total / MIB)

    sec = Table("cycles", f"Checkpoint cycles, {head}: seconds", "s")
    sec.add("pause → update_weights → resume, no verify", values=res["cycle_False"])
    sec.add("pause → update_weights → resume, verify", values=res["cycle_True"])
    sec.add("`rollbus publish` wall time, incl. Python and paddle start", values=res["cli_wall"])

    ipc_t = Table("ipc", f"ipc, rank 0 shard {ipc_size / MIB:.0f} MiB: seconds", "s")
    ipc_t.add("memcpy of the same bytes", values=copy)
    ipc_t.add("ipc stage: read into private memory + parse, handed to paddle", values=ipc,
              baseline="memcpy of the same bytes", target=("<=", 2.0))
    return [*pub_ts, *pull_ts, sec, ipc_t]
