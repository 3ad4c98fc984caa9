"""One tensor-parallel rank for test_tp_equivalence.py, and the scenario both sides run.

Run as a script (``python tp_equivalence_rank.py OUT.npz``) with the PADDLE_* env of one
rank set: it joins the gloo group, runs :func:`run_scenario` on its shard and saves the
result. The test imports this file to run the same scenario with tp=1 in process."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import paddle

from services.worker.model import Batch, KVCache, TPModel
from shared.model_config import ModelConfig
from shared.sharding import init_weights, shard_tensor

CONFIG = ModelConfig(
    vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=4, attention_bias=True,
)
SEED = 1234
PROMPTS = [[5, 9, 200, 17, 3, 3, 88], [250, 1, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
TABLES = [[9, 2, 14, 5], [0, 11, 7], [3, 12, 1, 8, 6]]  # shuffled, non-contiguous
BLOCK_SIZE, NUM_BLOCKS, DECODE_STEPS, CHUNK = 4, 16, 4, 6


def run_scenario(rank: int, tp: int, group: object = None) -> dict[str, np.ndarray]:
    """Prefill (the third prompt in two chunks, alongside decodes) then greedy decode;
    returns the logits of every step and the greedy tokens."""
    full = init_weights(CONFIG, SEED)
    # Scale the std-0.02 init up so logits differ clearly between tokens.
    weights = {
        n: paddle.to_tensor(shard_tensor(CONFIG, n, w if n.endswith("norm.weight") else w * 8,
                                         rank, tp))
        for n, w in full.items()
    }
    model, kv = TPModel(CONFIG, rank, tp, group), KVCache(CONFIG, NUM_BLOCKS, BLOCK_SIZE, tp)
    seqs = [list(p) for p in PROMPTS]
    cached = [0] * len(seqs)
    logits, tokens = [], []
    for step in range(2 + DECODE_STEPS):
        # step 0 feeds only the first chunk of the last prompt: a chunked prefill that
        # shares step 1 with two decodes.
        ends = [CHUNK if (step == 0 and s == 2) else len(seq) for s, seq in enumerate(seqs)]
        new = [seq[cached[s]:ends[s]] for s, seq in enumerate(seqs)]
        out = model.forward(weights, kv, Batch(new, list(cached), TABLES)).numpy()
        picked = out.argmax(axis=-1)
        logits.append(out)
        tokens.append(picked)
        for s, seq in enumerate(seqs):
            cached[s] += len(new[s])
            if cached[s] == len(seq):
                seq.append(int(picked[s]))
    return {"logits": np.stack(logits), "tokens": np.stack(tokens)}


def main() -> None:
    import paddle.distributed as dist

    group = dist.init_parallel_env()
    result = run_scenario(dist.get_rank(), dist.get_world_size(), group)
    np.savez(Path(sys.argv[1]), **result)


if __name__ == "__main__":
    main()
