"""Fleet update time for 1, 2 and 3 instances against the single-instance update, same run.

Three stacks at TP=1 on the bench's nats-server. Per run, interleaved: the baseline
(``pause keep`` -> ``update_weights`` -> ``resume`` on one instance, over NATS as the
coordinator talks), then one fleet transaction (``shared.fleet.Coordinator.update``) over
the first 1, 2 and 3 instances; wall time of each, to a version none of them serves
(snapshot copies of the model dir, so every update loads and switches real weights).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from shared import fleet as f
from shared.bus import Bus
from shared.subjects import Subjects
from tests.bench.common import Table, start_stack_retry

log = logging.getLogger("bench")
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4}


def _version(stacks: list, name: str) -> str:  # type: ignore[type-arg]
    for s in stacks:
        d = s.model_dir / "versions" / name
        d.mkdir(parents=True, exist_ok=True)
        for p in s.model_dir.glob("*.safetensors"):
            shutil.copy(p, d / p.name)
        shutil.copy(s.model_dir / "config.json", d / "config.json")
    return name


async def _ctl(bus: Bus, instance: str, method: str, body: bytes, timeout: float) -> None:
    rep = await bus.request(Subjects(instance).ctl(method), body, timeout=timeout)
    if b'"error_code":200' not in rep.data:
        raise RuntimeError(f"{instance} {method}: {rep.data[:300]!r}")


async def _measure(url: str, stacks: list, runs: int, ct: float) -> Table:  # type: ignore[type-arg]
    names = [s.instance for s in stacks]
    mb = sum(p.stat().st_size for p in stacks[0].model_dir.glob("*.safetensors")) / (1 << 20)
    t = Table(
        "fleet",
        f"Fleet update, TP=1 instances, {mb:.0f} MiB of weights each: seconds from the "
        "call to every instance serving the new version",
        "s",
    )
    base = "one instance: pause keep → update_weights → resume"
    t.add(base)
    for k in range(1, len(stacks) + 1):
        t.add(f"fleet transaction over {k} instance{'s' if k > 1 else ''}", baseline=base)
    t.notes.append(
        "fleet: pause + stage on every instance at once, decision written to the KV "
        "bucket, commit, decision done, finalize + resume (shared/fleet.py); instances "
        "given, so no discovery window (`rollbus fleet update` adds 0.5 s of `$SRV.PING`)"
    )
    bus = await Bus.connect(url, "bench-fleet")
    coord = f.Coordinator(bus, ct, name="bench")
    seq = 0
    try:
        for run in range(runs):
            seq += 1
            v = _version(stacks[:1], f"b{seq}")
            t0 = time.perf_counter()
            await _ctl(bus, names[0], "pause", b'{"mode":"keep"}', ct)
            await _ctl(bus, names[0], "update_weights", f'{{"version":"{v}"}}'.encode(), 2 * ct)
            await _ctl(bus, names[0], "resume", b"{}", ct)
            t.rows[0].values.append(time.perf_counter() - t0)
            for k in range(1, len(stacks) + 1):
                seq += 1
                v = _version(stacks[:k], f"b{seq}")
                t0 = time.perf_counter()
                res = await coord.update(v, "keep", None, instances=names[:k])
                dt = time.perf_counter() - t0
                if res.error_code != 200:
                    raise RuntimeError(f"fleet update failed: {res.error_message}")
                t.rows[k].values.append(dt)
            log.info("fleet run %d/%d: %s", run + 1, runs,
                     ", ".join(f"{r.values[-1]:.2f}s" for r in t.rows))
    finally:
        await bus.close()
    return t


def run(tmp: Path, nats_url: str, runs: int = 5, quick: bool = False) -> list[Table]:
    ct = 60.0
    env = {"ROLLBUS_CONTROL_TIMEOUT_S": str(ct), "ROLLBUS_LOG_LEVEL": "warning"}
    stacks = []
    try:
        for k in range(3):
            stacks.append(start_stack_retry(
                tmp / f"fleet{k}", nats_url, tp=1, env=env,
                model_config=None if quick else MODEL,
            ))
        return [asyncio.run(_measure(nats_url, stacks, runs, ct))]
    finally:
        for s in stacks:
            s.stop()
