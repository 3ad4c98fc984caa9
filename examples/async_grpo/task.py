"""The toy task: add two 1-digit numbers (the 55 pairs whose sum has one digit). A
verifiable reward that random output scores badly on.

Vocabulary (16 ids; a WordLevel ``tokenizer.json`` so the served model reads and writes
text too): ``0``-``9`` are ids 0-9, ``+`` 10, ``=`` 11, ``<bos>`` 12, ``<eos>`` 13,
``<pad>`` 14, ``<unk>`` 15. A prompt is ``<bos> a + b =`` (``"3+9="``); the answer is the
digit of ``a + b`` then ``<eos>`` (``"3+5="`` → ``8 <eos>``).

Reward of a completion: the fraction of the answer (digit and ``<eos>``) it gets right
before its first mistake — 1.0 for exactly ``8 <eos>``, 0.5 for ``8 8``, 0 for a wrong
digit. A uniformly random policy scores about 0.03.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

TOKENS = [*"0123456789", "+", "=", "<bos>", "<eos>", "<pad>", "<unk>"]
VOCAB = {t: i for i, t in enumerate(TOKENS)}
PLUS, EQ, BOS, EOS = VOCAB["+"], VOCAB["="], VOCAB["<bos>"], VOCAB["<eos>"]
VOCAB_SIZE = len(TOKENS)
MAX_TOKENS = 2  # the digit, then <eos>
PROMPTS = [(a, b) for a in range(5) for b in range(5)]  # 25 pairs, sums 0-8


def prompt_ids(a: int, b: int) -> list[int]:
    return [BOS, a, PLUS, b, EQ]


def answer_ids(a: int, b: int) -> list[int]:
    return [int(c) for c in str(a + b)] + [EOS]


def reward(a: int, b: int, completion: Sequence[int]) -> float:
    want = answer_ids(a, b)
    right = 0
    for got, exp in zip(completion, want, strict=False):
        if got != exp:
            break
        right += 1
    return right / len(want)


def text(ids: Sequence[int]) -> str:
    return "".join(TOKENS[i] if 0 <= i < VOCAB_SIZE else "?" for i in ids)


def write_tokenizer(model_dir: Path) -> None:
    """``tokenizer.json`` (WordLevel, one token per character, specials added) and
    ``tokenizer_config.json`` naming ``<bos>`` / ``<eos>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<bos>", "<eos>", "<pad>", "<unk>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
    )
