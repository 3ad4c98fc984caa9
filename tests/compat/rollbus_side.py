"""rollbus's answer for a model dir, through the worker's real code in process: config
parsing (``load_config``), the snapshot source (bf16/fp16 -> fp32, TP slices), the TP
model and its paged KV cache, greedy decoding that stops on every eos id of the model's
configs (the API's rule, :func:`shared.tokenizer.config_eos_ids`).

Run as a script (``python rollbus_side.py JOBS.json``) with one rank's PADDLE_* env: it
joins the gloo group and runs every job of the file at that TP, writing ``<out>.npz``
per job; the test imports :func:`greedy` to run TP=1 in process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from services.worker import model as mdl
from services.worker.shmreduce import ShmAllReduce, default_root, segment_dir
from services.worker.weights import SnapshotSource, to_paddle
from shared.model_config import load_config
from shared.tokenizer import config_eos_ids
from shared.versions import model_dir_version

BLOCK = 4


def greedy(
    model_dir: Path, prompt: list[int], new_tokens: int, rank: int = 0, tp: int = 1,
    group: Any = None, chunk: int = 0, shm: Any = None,
) -> dict[str, np.ndarray]:
    """Greedy tokens, their logprobs and every step's log_softmax [steps, vocab].
    ``chunk`` > 0 feeds the prompt in chunks of that many tokens (chunked prefill)."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    shard = SnapshotSource(cfg, model_dir, rank, tp)(model_dir_version(model_dir), False)
    weights = to_paddle(shard.arrays)
    total = len(prompt) + new_tokens
    blocks = -(-total // BLOCK)
    kv = mdl.KVCache(cfg, blocks + 3, BLOCK, tp)
    table = list(range(blocks + 3))[::-1][:blocks]  # non-contiguous, reversed
    model = mdl.TPModel(cfg, rank, tp, group, shm)
    stops = set(config_eos_ids(model_dir))
    seq, cached = list(prompt), 0
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    while len(tokens) < new_tokens:
        step = len(seq) - cached if not chunk else min(chunk, len(seq) - cached)
        batch = mdl.Batch([seq[cached : cached + step]], [cached], [table])
        out = model.forward(weights, kv, batch)
        cached += step
        if cached < len(seq):
            continue  # a prefill chunk that does not end the prompt samples nothing
        logits = out.numpy()[0].astype(np.float64)
        logp = logits - logits.max()
        logp = logp - np.log(np.exp(logp).sum())
        tok = int(np.argmax(logp))
        rows.append(logp)
        tokens.append(tok)
        seq.append(tok)
        if tok in stops:
            break
    logps = np.stack(rows)
    return {
        "tokens": np.array(tokens),
        "logprobs": logps[np.arange(len(tokens)), tokens],
        "log_softmax": logps,
    }


def main() -> None:
    import paddle.distributed as dist

    paddle.base.core.set_num_threads(1)
    jobs = json.loads(Path(sys.argv[1]).read_text())
    group = dist.init_parallel_env()
    rank, tp = dist.get_rank(), dist.get_world_size()
    # the worker's same-host all-reduce (4 MiB slots; a larger prefill falls back to gloo)
    where = segment_dir(default_root(), os.environ.get("PADDLE_TRAINER_ENDPOINTS", ""))
    shm = ShmAllReduce(rank, tp, 4 << 20, where, dist.barrier, 600.0) if tp > 1 else None
    for job in jobs:
        result = greedy(
            Path(job["model_dir"]), job["prompt"], job["new_tokens"], rank, tp, group,
            job.get("chunk", 0), shm,
        )
        np.savez(Path(f"{job['out']}.rank{rank}.npz"), **result)


if __name__ == "__main__":
    main()
