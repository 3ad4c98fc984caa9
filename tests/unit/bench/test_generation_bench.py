"""The generation benchmark's transformers baseline gets exactly rollbus's prompts."""

from __future__ import annotations

from tests.bench import generation, hf_generate


def test_transformers_baseline_gets_the_same_prompts_as_rollbus() -> None:
    batch, vocab = 16, generation.MODEL["vocab_size"]
    hf = hf_generate.prompts(batch, generation.PROMPT_LEN, vocab)
    ours = [generation._body(i, False)["prompt"] for i in range(batch)]
    assert hf == ours
    assert all(len(p) == generation.PROMPT_LEN for p in hf)
    assert len({tuple(p) for p in hf}) == batch  # 16 different prompts, not one repeated
