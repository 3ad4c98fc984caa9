"""Thread-CPU time per part of one rank's step: ``python -m tests.bench.step_parts MODEL_DIR
[--tp N] [--rank R] [--steps N]``.

Runs the worker's real :class:`TPModel` in this one process on rank ``R``'s TP shards (the
all-reduce replaced by identity: the shapes and the work of that rank, no peer to wait
for), with ``cores // tp`` paddle threads, and times each part with ``time.thread_time``
— CPU time of this thread, which other jobs on a shared host inflate far less than wall
time (cProfile's ``profile_step`` shows waits; this shows work). Prints the prefill of
``--batch`` prompts of ``--prompt-len`` tokens and the mean greedy decode step, by part.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(prog="step_parts")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()

    import numpy as np
    import paddle

    from services.worker import model as mdl
    from services.worker.weights import SnapshotSource, to_paddle
    from shared.model_config import load_config
    from shared.versions import model_dir_version

    paddle.base.core.set_num_threads(max(1, (os.cpu_count() or 1) // a.tp))
    cfg = load_config(a.model_dir)
    src = SnapshotSource(cfg, a.model_dir, a.rank, a.tp)
    w = to_paddle(src(model_dir_version(a.model_dir), False).arrays)
    cpu: collections.Counter[str] = collections.Counter()

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def g(*args: Any, **kw: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*args, **kw)
            finally:
                cpu[name] += time.thread_time() - t

        return g

    for name in ("_linear", "_attend", "_rope", "_rms_norm"):
        setattr(mdl, name, timed(name, getattr(mdl, name)))
    mdl.paddle.scatter_ = timed("KV writes (scatter_)", mdl.paddle.scatter_)  # type: ignore[attr-defined]
    mdl.TPModel._all_reduce = lambda self, t: t  # type: ignore[method-assign]
    model = mdl.TPModel(cfg, a.rank, a.tp)
    model._plan = timed("_plan", model._plan)  # type: ignore[method-assign]
    bs = 16
    per = -(-(a.prompt_len + a.steps + 2) // bs)
    kv = mdl.KVCache(cfg, per * a.batch, bs, a.tp)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(a.batch)]
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(a.prompt_len)] for i in range(a.batch)]

    def show(what: str, total: float, n: int) -> None:
        print(f"{what}: {total / n * 1e3:.1f} thread-CPU ms")
        for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]):
            print(f"  {v / n * 1e3:7.2f} ms  {k}")
        print(f"  {(total - sum(cpu.values())) / n * 1e3:7.2f} ms  the rest")
        cpu.clear()

    model.forward(w, kv, mdl.Batch(prompts, [0] * a.batch, tables))  # warm up
    cpu.clear()
    t = time.thread_time()
    logits = model.forward(w, kv, mdl.Batch(prompts, [0] * a.batch, tables))
    show(f"prefill ({a.batch} x {a.prompt_len} tokens)", time.thread_time() - t, 1)
    last = [int(x) for x in np.argmax(logits.numpy(), -1)]
    t = time.thread_time()
    for step in range(a.steps):
        pos = [a.prompt_len + step] * a.batch
        out = model.forward(w, kv, mdl.Batch([[x] for x in last], pos, tables))
        last = [int(x) for x in np.argmax(out.numpy(), -1)]
    show(f"decode step (batch {a.batch}, mean of {a.steps})", time.thread_time() - t, a.steps)


if __name__ == "__main__":
    main()
