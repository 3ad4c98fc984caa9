"""transformers' ``generate`` as the generation benchmark's baseline, in its own process.

``python -m tests.bench.hf_generate build DIR`` writes the bench model with transformers'
own classes (``LlamaForCausalLM`` from a ``LlamaConfig``, random weights,
``save_pretrained`` safetensors, fp32); rollbus serves that same directory.

``python -m tests.bench.hf_generate serve DIR BATCH PROMPT_LEN NEW_TOKENS`` loads it (torch
CPU, fp32, ``torch.set_num_threads(cores)``), warms up, prints ``ready``, then answers each
``run`` line on stdin with one JSON line: output tokens/s of one greedy ``generate`` of the
batch (every sequence generates exactly NEW_TOKENS tokens: ``min_new_tokens`` is what
``ignore_eos`` is for rollbus). Its own process, so torch's threads never share one with
paddle's or the benchmark client's; it sits idle (blocked on stdin) while rollbus runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """The benchmark's prompts (the same token ids rollbus gets)."""
    return [[256 % vocab] + [(7 * i + j) % 250 for j in range(prompt_len - 1)]
            for i in range(batch)]


def build(out: Path, model: dict[str, Any]) -> Path:
    import torch
    import transformers as tf

    if (out / "config.json").is_file():
        return out
    cfg = tf.LlamaConfig(**model, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def serve(model_dir: Path, batch: int, prompt_len: int, new_tokens: int) -> None:
    import torch
    import transformers as tf

    torch.set_num_threads(os.cpu_count() or 1)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor(prompts(batch, prompt_len, vocab))

    def once() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            )
        dt = time.perf_counter() - t0
        assert out.shape == (batch, prompt_len + new_tokens), out.shape
        return batch * new_tokens / dt

    once()  # warm up
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(json.dumps({"tokens_per_s": once(), "threads": torch.get_num_threads()}),
                  flush=True)


if __name__ == "__main__":
    cmd, path = sys.argv[1], Path(sys.argv[2])
    if cmd == "build":
        build(path, json.loads(sys.argv[3]))
    else:
        serve(path, *(int(a) for a in sys.argv[3:6]))
