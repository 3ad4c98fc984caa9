"""The Python CPU of one decode step's bookkeeping, in one process: no bus, no paddle.

``python -m tests.bench.step_cpu [--batch 16] [--steps 64] [--reps 20] [--code DIR ...]``

Per step of ``batch`` greedy requests (16-token prompts, ``steps`` new tokens, as the
generation bench): the engine's plan (``Scheduler.schedule``), the step message's
encoding, a rank's decoding and check (``check_step``: every rank, on its event loop)
and the engine's ``apply`` of the reply, each in thread CPU time, the best of ``reps``
batches (µs per step). At TP=1 on two cores every CPU-second of these comes out of the
rank's compute. ``--code`` runs the same in each checkout (a subprocess with that
checkout's ``services`` and ``shared``; this file need not be in it), alternating,
three times: an A/B on a busy host."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from services.engine.scheduler import Plan, Scheduler
from services.worker.stepcheck import StepLimits, check_step
from shared import messages as m

PARTS = ("plan", "encode", "decode+check", "apply")


def measure(batch: int, steps: int, reps: int) -> dict[str, float]:
    """Seconds per step of each part, the best of ``reps`` batches."""
    best: dict[str, float] = {}
    lim = StepLimits(32000, 1024, 16, 2048)
    for _ in range(reps):
        tot = dict.fromkeys(PARTS, 0.0)
        s = Scheduler(1024, 16, 256, 8192, 2048)
        for i in range(batch):
            prompt = [1 + (i + j) % 200 for j in range(16)]
            gen = m.GenRequest(f"r{i}", prompt, steps, temperature=0.0, batch=True, coalesce=True)
            s.add(gen, "_INBOX.x.1")
        n = 0
        while (plan := _timed(tot, "plan", s.schedule)) is not None:
            data = _timed(tot, "encode", m.pack, plan.step)
            _timed(tot, "decode+check", _check, data, lim)
            ids = [sp.seq_id for r in plan.step.rows for sp in r.sample]
            reply = m.pack(m.StepReply(plan.step.step, ids, [7] * len(ids), [0.0] * len(ids)))
            _timed(tot, "apply", _apply, s, plan, reply)
            n += 1
        for k, v in tot.items():
            best[k] = min(best.get(k, 1e9), v / n)
    return best


def _check(data: bytes, lim: StepLimits) -> str | None:
    return check_step(m.unpack(data, type=m.StepRequest), lim)


def _apply(s: Scheduler, plan: Plan, reply: bytes) -> object:
    return s.apply(plan, m.unpack(reply, type=m.StepReply), "v")


def _timed(tot: dict[str, float], part: str, fn: object, *args: object) -> object:
    t0 = time.thread_time()
    out = fn(*args)  # type: ignore[operator]
    tot[part] += time.thread_time() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="step_cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--code", type=Path, action="append", default=[])
    args = ap.parse_args()
    if not args.code:
        res = measure(args.batch, args.steps, args.reps)
        print(" ".join(f"{k} {v * 1e6:.0f}" for k, v in res.items()) + " (µs per step)")
        return
    for _ in range(3):
        for code in args.code:
            env = {**os.environ, "PYTHONPATH": str(code.resolve())}
            # this file, run as a script: the other checkout's services and shared
            cmd = [sys.executable, __file__, "--batch", str(args.batch),
                   "--steps", str(args.steps), "--reps", str(args.reps)]  # fmt: skip
            out = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
            print(f"{code}: {out.stdout.strip() or out.stderr.strip()[-300:]}", flush=True)


if __name__ == "__main__":
    main()
