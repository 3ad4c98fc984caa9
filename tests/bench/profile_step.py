"""Where a decode step's time goes: ``python -m tests.bench.profile_step MODEL_DIR [--tp N]``.

Runs the worker's real model code (snapshot load, :class:`TPModel`, paged KV cache) on
``--tp`` rank processes of this host (gloo plus the shared-memory all-reduce, as
``rollbus serve`` starts them; each with ``cores // tp`` paddle threads), prefills
``--batch`` prompts, then profiles ``--steps`` greedy decode steps with cProfile on every
rank and prints rank 0's share of the step time per part: linear matmuls, attention,
RoPE, norms, KV cache writes, all-reduces, the step plan (host side) and the rest.
Shares, not absolute times, are what to read on a shared machine.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import subprocess
import sys
import time
from pathlib import Path

PARTS = {  # part -> functions (file suffix, function name) whose cumulative time it is
    "linear matmuls (q/k/v/o, MLP, lm_head)": [("model.py", "_linear")],
    "attention (block gather, matmuls, softmax)": [("model.py", "_attend")],
    "rope": [("model.py", "_rope")],
    "rms norms": [("model.py", "_rms_norm")],
    "KV cache writes": [("~", "<built-in method paddle.base.libpaddle.pir.ops.scatter_>")],
    "all-reduce (shared memory, or gloo)": [
        ("communication/all_reduce.py", "all_reduce"), ("shmreduce.py", "reduce")],
    "step plan (host: positions, masks, to_tensor)": [("model.py", "_plan")],
    "argmax + .numpy() of the logits": [("~", "<method 'numpy' of 'paddle.Tensor' objects>")],
}


def _cum(stats: pstats.Stats, file: str, func: str) -> float:
    total = 0.0
    for (fname, _, name), (_, _, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name == func and fname.endswith(file):
            total += cum
    return total


def rank_main(model_dir: Path, tp: int, batch: int, prompt_len: int, steps: int) -> None:
    import numpy as np
    import paddle

    from services.worker import model as mdl
    from services.worker.comm import CommGroup
    from services.worker.weights import SnapshotSource, to_paddle
    from shared.model_config import load_config
    from shared.versions import model_dir_version

    threads = max(1, (os.cpu_count() or 1) // tp)
    paddle.base.core.set_num_threads(threads)
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    cfg = load_config(model_dir)
    # the served ranks' communication: gloo group + same-host shared-memory all-reduce
    comm = CommGroup(rank, tp, max(batch * prompt_len, batch) * cfg.hidden_size * 4 * (tp > 1))
    comm.init()
    shard = SnapshotSource(cfg, model_dir, rank, tp)(model_dir_version(model_dir), False)
    w = to_paddle(shard.arrays)
    bs = 16
    per = -(-(prompt_len + 2 * steps + 2) // bs)
    kv = mdl.KVCache(cfg, per * batch, bs, tp)
    model = mdl.TPModel(cfg, rank, tp, comm.group, comm.shm)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(prompt_len)] for i in range(batch)]
    logits = model.forward(w, kv, mdl.Batch(prompts, [0] * batch, tables))
    last = [int(t) for t in np.argmax(logits.numpy(), -1)]
    pos = prompt_len

    def decode(n: int) -> None:
        nonlocal last, pos
        for _ in range(n):
            out = model.forward(w, kv, mdl.Batch([[t] for t in last], [pos] * batch, tables))
            last = [int(t) for t in np.argmax(out.numpy(), -1)]
            pos += 1

    decode(2)  # warm up
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    decode(steps)
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    parts = {k: sum(_cum(stats, f, n) for f, n in v) for k, v in PARTS.items()}
    total = sum(parts.values())
    parts["other (Python, embedding, residual adds, ...)"] = max(0.0, wall - total)
    print(json.dumps({"rank": rank, "tp": tp, "threads": threads, "wall": wall,
                      "step_ms": wall / steps * 1e3, "tokens_per_s": batch * steps / wall,
                      "parts": parts}), flush=True)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def main() -> None:
    ap = argparse.ArgumentParser(prog="profile_step")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_main or a.tp == 1:
        rank_main(a.model_dir, a.tp, a.batch, a.prompt_len, a.steps)
        return
    eps = [f"127.0.0.1:{p}" for p in _free_ports(a.tp)]
    procs = []
    for r in range(a.tp):
        env = {**os.environ, "PADDLE_TRAINER_ID": str(r), "PADDLE_TRAINERS_NUM": str(a.tp),
               "PADDLE_TRAINER_ENDPOINTS": ",".join(eps), "PADDLE_CURRENT_ENDPOINT": eps[r],
               "PADDLE_DISTRI_BACKEND": "gloo", "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.bench.profile_step", str(a.model_dir), "--rank-main",
             f"--tp={a.tp}", f"--batch={a.batch}", f"--prompt-len={a.prompt_len}",
             f"--steps={a.steps}"],
            env=env, stdout=subprocess.PIPE if r else None, stderr=subprocess.DEVNULL))
    for p in procs:
        p.wait(timeout=1800)


def report(line: str) -> str:
    """A rank's JSON line as a small table (for the README)."""
    d = json.loads(line)
    out = [f"tp={d['tp']}, {d['threads']} thread(s)/rank: {d['step_ms']:.1f} ms/step, "
           f"{d['tokens_per_s']:.1f} tokens/s (under cProfile)"]
    for k, v in sorted(d["parts"].items(), key=lambda kv: -kv[1]):
        out.append(f"  {100 * v / d['wall']:5.1f} %  {k}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
