"""The compatibility cases: one random-weight transformers model per case."""

from __future__ import annotations

from hf import CLASSES, Case

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so the scaling changes most bands
}
CASES = [
    Case("llama", "llama"),  # GQA (4 heads, 2 kv heads), untied, rope_parameters
    Case("llama-old-layout", "llama", layout="old"),  # top-level rope_theta
    Case("llama-linear", "llama", layout="old", rope={"rope_type": "linear", "factor": 2.0}),
    Case(
        "llama-dynamic",
        "llama",
        rope={"rope_type": "dynamic", "factor": 2.0},
        extra={"max_position_embeddings": 16},  # prompt + 16 new tokens grow past it
    ),
    Case("llama3", "llama", rope=LLAMA3),
    Case("llama3-old-layout", "llama", layout="old", rope=LLAMA3),
    Case("llama-bf16-sharded", "llama", dtype="bfloat16", max_shard_size="60KB"),
    # intermediate_size not divisible by TP (as transformers' model testers' 37): at TP=2
    # the MLP splits 19 + 18
    Case("llama-intermediate-37", "llama", extra={"intermediate_size": 37}),
    Case("qwen2", "qwen2", layout="old", theta=1e6, extra={"tie_word_embeddings": True}),
    # one kv head: at TP=2 both ranks hold a copy of it
    Case("qwen2-mqa", "qwen2", extra={"num_key_value_heads": 1}),
    Case("qwen2-bf16", "qwen2", dtype="bfloat16", extra={"tie_word_embeddings": True}),
    # use_sliding_window with no layer from max_window_layers on: full attention in
    # transformers (a window of 4 would change every token past the 4th if it slid)
    Case(
        "qwen2-window-unused",
        "qwen2",
        layout="old",
        extra={"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    ),
    # attention_bias: q/k/v and o_proj biases (o_proj's added once, after the all-reduce);
    # mlp_bias: gate/up (split) and down (whole) biases; with 37 MLP columns (19 + 18)
    Case(
        "llama-biases",
        "llama",
        extra={"attention_bias": True, "mlp_bias": True, "intermediate_size": 37},
    ),
    Case("qwen3", "qwen3", extra={"head_dim": 32}),  # head_dim != hidden / heads (16)
    Case("qwen3-attention-bias", "qwen3", extra={"head_dim": 32, "attention_bias": True}),
    Case("qwen3-fp16-old-layout", "qwen3", layout="old", dtype="float16", extra={"head_dim": 32}),
]
if "ernie4_5" in CLASSES:
    CASES.append(Case("ernie4_5", "ernie4_5", extra={"head_dim": 32}))
    # use_bias: q/k/v/o and gate/up/down biases
    CASES.append(Case("ernie4_5-bias", "ernie4_5", extra={"head_dim": 32, "use_bias": True}))
BY_NAME = {c.name: c for c in CASES}

PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 300, 11], [250, 1, 64]]
NEW_TOKENS = 16
