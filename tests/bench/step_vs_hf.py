"""A step of rollbus's model code against transformers, same shapes, one process, interleaved.

``python -m tests.bench.step_vs_hf [--threads N] [--rounds R] [--steps S] [--before PATH]``
loads the generation benchmark's model (built with transformers if missing) into the
worker's :class:`TPModel` (TP=1, paged KV cache) and into transformers
(``AutoModelForCausalLM``, fp32, its own KV cache), then per round, alternating: the
16 × 16-token prompts' prefill and ``--steps`` greedy decode steps on each. With
``--before PATH`` (another checkout's ``services/worker/model.py``) that code runs too, on
the same weights: before/after in the same run. Reports medians of the prefill and of a
decode step, wall and CPU (the process's; at 1 thread it is the op cost alone, robust on
a busy host), and checks that all produce the same greedy tokens. ``tokens_per_s`` and
``tokens_per_cpu_s``: the generation benchmark's work (prefill + 63 decode steps) from
those medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.bench import generation as g
from tests.bench.hf_generate import prompts

Result = tuple[float, float, float, float, list[list[int]]]  # wall, CPU: prefill, decode


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("rollbus_model_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(prog="step_vs_hf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--before", type=Path, help="another services/worker/model.py to compare")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/rollbus-gen-where/bench"))
    a = ap.parse_args()
    if not (a.model_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tests.bench.hf_generate", "build",
                        str(a.model_dir), json.dumps(g.MODEL)], check=True)
    import numpy as np
    import paddle
    import torch
    import transformers as tf

    from services.worker import model as mdl
    from services.worker.weights import SnapshotSource, to_paddle
    from shared.model_config import load_config
    from shared.versions import model_dir_version

    paddle.base.core.set_num_threads(a.threads)
    torch.set_num_threads(a.threads)
    cfg = load_config(a.model_dir)
    shard = SnapshotSource(cfg, a.model_dir, 0, 1)(model_dir_version(a.model_dir), False)
    w = to_paddle(shard.arrays)
    b, p = a.batch, g.PROMPT_LEN
    ids = prompts(b, p, cfg.vocab_size)
    bs = 16
    per = -(-(p + a.steps + 1) // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]

    def rollbus(module: Any) -> Callable[[], Result]:
        kv = module.KVCache(cfg, per * b, bs, 1)
        model = module.TPModel(cfg, 0, 1)

        def run() -> Result:
            c0, t0 = time.process_time(), time.perf_counter()
            out = model.forward(w, kv, module.Batch(ids, [0] * b, tables))
            last = [int(t) for t in np.argmax(out.numpy(), -1)]
            c1, t1 = time.process_time(), time.perf_counter()
            toks = [last]
            for s in range(a.steps):
                batch = module.Batch([[t] for t in last], [p + s] * b, tables)
                last = [int(t) for t in np.argmax(model.forward(w, kv, batch).numpy(), -1)]
                toks.append(last)
            return t1 - t0, time.perf_counter() - t1, c1 - c0, time.process_time() - c1, toks

        return run

    hf = tf.AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()

    def transformers() -> Result:
        x = torch.tensor(ids)
        with torch.no_grad():
            c0, t0 = time.process_time(), time.perf_counter()
            out = hf(x, use_cache=True, logits_to_keep=1)
            last = out.logits[:, -1].argmax(-1)
            c1, t1 = time.process_time(), time.perf_counter()
            toks = [last.tolist()]
            for s in range(a.steps):
                out = hf(last[:, None], past_key_values=out.past_key_values, use_cache=True,
                         position_ids=torch.full((b, 1), p + s))
                last = out.logits[:, -1].argmax(-1)
                toks.append(last.tolist())
            return t1 - t0, time.perf_counter() - t1, c1 - c0, time.process_time() - c1, toks

    runs = {"rollbus": rollbus(mdl), "transformers": transformers}
    if a.before:
        runs = {"rollbus before": rollbus(_load(a.before)), **runs}
    for f in runs.values():
        f()  # warm up
    res: dict[str, dict[str, list[float]]] = {k: {} for k in runs}
    for _ in range(a.rounds):
        tokens = []
        for name, f in runs.items():
            pre, dec, cpu_pre, cpu_dec, toks = f()
            r = res[name]
            r.setdefault("prefill_ms", []).append(pre * 1e3)
            r.setdefault("step_ms", []).append(dec / a.steps * 1e3)
            r.setdefault("prefill_cpu_ms", []).append(cpu_pre * 1e3)
            r.setdefault("step_cpu_ms", []).append(cpu_dec / a.steps * 1e3)
            tokens.append(toks)
        assert all(t == tokens[0] for t in tokens), "greedy tokens differ"
    for name, r in res.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        total = med["prefill_ms"] + (g.STEPS - 1) * med["step_ms"]
        cpu = med["prefill_cpu_ms"] + (g.STEPS - 1) * med["step_cpu_ms"]
        print(json.dumps({"name": name, "threads": a.threads,
                          **{k: round(v, 2) for k, v in med.items()},
                          "prefill_min_ms": round(min(r["prefill_ms"]), 1),
                          "step_min_ms": round(min(r["step_ms"]), 2),
                          "tokens_per_s": round(b * g.STEPS / total * 1e3, 1),
                          "tokens_per_cpu_s": round(b * g.STEPS / cpu * 1e3, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
