"""A model dir's ``tokenizer.json`` encodes as transformers' ``AutoTokenizer`` encodes it:
the same ids for text (BOS or none as transformers adds it) and for rendered chats.

transformers 5 picks the tokenizer class from the model's ``model_type`` as well as from
``tokenizer_config.json``, and some classes build their own pipeline around the
vocabulary: a ``qwen2`` model (whatever ``tokenizer_class`` says) or a ``qwen3`` one naming
no class gets ``Qwen2Tokenizer``, which splits digits one by one and contractions with its
own regex. The tokenizers here are plain byte-level BPE ``tokenizer.json`` files (as a test
would build one with ``tokenizers``), so the pipelines differ where it matters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers as tf
from tokenizers import Tokenizer, processors

from shared.tokenizer import load_tokenizer
from tests.fixtures.chat import CHATS, FAMILIES, make_tokenizer_dir

TEXTS = [
    "hello world",
    "It's 12345 o'clock, don't   wait\n\n  x",
    "e\u0301t\u00e9 caf\u00e9 日本語 🙂",
    "<|im_start|>user\nhi 42<|im_end|>",
    " leading space and trailing  ",
]
CASES = [  # (model_type, tokenizer_class in tokenizer_config.json, tokenizer family, BOS)
    ("qwen2", "PreTrainedTokenizerFast", "qwen2.5", False),
    ("qwen2", "Qwen2Tokenizer", "qwen2.5", True),  # Qwen2Tokenizer keeps it too
    ("qwen3", None, "qwen3", False),
    ("qwen3", "PreTrainedTokenizerFast", "qwen3", True),
    ("llama", "PreTrainedTokenizerFast", "llama3.1", True),  # as Llama-3's tokenizer.json
    ("llama", None, "llama3.1", False),
]
CONFIG = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4}  # fmt: skip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    out = {}
    for model_type, cls, family, bos in CASES:
        d = make_tokenizer_dir(tmp_path_factory.mktemp("tok") / family, family)
        if bos:  # tokenizer.json's post-processor puts the first special token first
            raw = Tokenizer.from_file(str(d / "tokenizer.json"))
            first = FAMILIES[family][1][0]
            raw.post_processor = processors.TemplateProcessing(
                single=f"{first} $A", special_tokens=[(first, raw.token_to_id(first))]
            )
            raw.save(str(d / "tokenizer.json"))
        tcfg = json.loads((d / "tokenizer_config.json").read_text())
        if cls is None:
            del tcfg["tokenizer_class"]
        else:
            tcfg["tokenizer_class"] = cls
        (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
        (d / "config.json").write_text(json.dumps({"model_type": model_type, **CONFIG}))
        out[(model_type, cls, family, bos)] = d
    return out


IDS = [f"{m}-{c}-{'bos' if b else 'none'}" for m, c, _, b in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_text_and_chat_ids_equal_transformers(dirs: dict[tuple, Path], case: tuple) -> None:
    d = dirs[case]
    theirs, ours = tf.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], (type(theirs).__name__, text)
        assert (
            ours.encode(text, add_special_tokens=False)
            == theirs(text, add_special_tokens=False)["input_ids"]
        )
    chat = [*CHATS["multi_turn"][:-1], {"role": "user", "content": TEXTS[1]}]
    want = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    text = ours.apply_chat_template(chat, True)
    assert ours.encode(text, add_special_tokens=False) == want["input_ids"]


@pytest.mark.parametrize("legacy", [None, True])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "ernie4_5"])
def test_sentencepiece_style_llama_tokenizer_equals_transformers(
    tmp_path: Path, model_type: str, legacy: bool | None
) -> None:
    """A Metaspace BPE ``tokenizer.json`` (Llama-2 style, written with ``tokenizers``'
    default ``prepend_scheme="always"``) named ``LlamaTokenizerFast``: transformers
    builds its own Metaspace pipeline (``first`` unless ``legacy``: no ``▁`` after a
    special token) — except for ernie4_5, whose hub class it distrusts."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    raw.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    raw.train_from_iterator(["hello world the quick brown fox 12345 it's there"] * 10, trainer)
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    tcfg: dict = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>",
                  "eos_token": "</s>", "unk_token": "<unk>"}  # fmt: skip
    if legacy is not None:
        tcfg["legacy"] = legacy
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **CONFIG}))
    theirs, ours = tf.AutoTokenizer.from_pretrained(str(tmp_path)), load_tokenizer(tmp_path)
    for text in ["hello world", " hello  world", "hi</s>there <s> x", *TEXTS]:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, (type(theirs).__name__, text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("kind", ["wordlevel", "bpe-unk"])
def test_qwen2_rebuilds_any_tokenizer_json_as_bpe(tmp_path: Path, kind: str) -> None:
    """transformers' ``Qwen2Tokenizer`` (what a ``qwen2`` model gets, whatever the file
    names) rebuilds the model as its own BPE over the file's vocabulary: a WordLevel
    ``tokenizer.json`` (as a test builds one with ``tokenizers``) loses every word that
    is not a single byte-level piece, and a BPE's unknown token is dropped, not emitted."""
    from tokenizers import models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    if kind == "wordlevel":
        words = "the quick brown fox a hello world".split()
        vocab = {t: i for i, t in enumerate(specials + words)}
        raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:  # no byte alphabet: characters outside the corpus are unknown
        raw = Tokenizer(models.BPE(unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials)
        raw.train_from_iterator(["hello world the quick brown fox"] * 10, trainer)
    raw.add_special_tokens(specials)  # as PreTrainedTokenizerFast.save_pretrained marks them
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    tcfg = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>"}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **CONFIG}))
    theirs, ours = tf.AutoTokenizer.from_pretrained(str(tmp_path)), load_tokenizer(tmp_path)
    assert type(theirs).__name__ == "Qwen2Tokenizer"
    for text in ["the quick brown fox", " a hello", "héllo wörld 日本語 42", *TEXTS]:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, (kind, text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_named_special_tokens_are_special(tmp_path: Path, model_type: str) -> None:
    """Special tokens ``tokenizer_config.json`` names but ``tokenizer.json`` keeps as plain
    vocabulary entries: transformers adds them as special tokens, so they are skipped when
    decoding and split out of text whole (``Qwen2Tokenizer``'s byte-level pipeline would
    otherwise never see ``<s>``)."""
    from tokenizers import decoders, models, pre_tokenizers

    words = "<unk> <s> </s> the quick brown fox".split()
    raw = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece()
    raw.save(str(tmp_path / "tokenizer.json"))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": "</s>", "unk_token": "<unk>"}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **CONFIG}))
    theirs, ours = tf.AutoTokenizer.from_pretrained(str(tmp_path)), load_tokenizer(tmp_path)
    ids = [3, 1, 4, 2, 5, 0]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for text in ["the <s> fox", "the</s>quick"]:
        assert ours.encode(text) == theirs(text)["input_ids"], text


def test_a_named_special_token_added_as_plain_is_skipped_in_decode(tmp_path: Path) -> None:
    """``tokenizer.json`` adds ``<|endoftext|>`` as a plain (non-special) added token,
    while ``tokenizer_config.json`` names it ``pad_token``: transformers counts it among
    the special tokens and skips it in decode, so rollbus must too (it kept it: the
    token was already added, and left as it was)."""
    d = make_tokenizer_dir(tmp_path / "q", "qwen2.5")
    spec = json.loads((d / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        if t["content"] == "<|endoftext|>":
            t["special"] = False
    (d / "tokenizer.json").write_text(json.dumps(spec))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", **CONFIG}))
    theirs, ours = tf.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    text = "<|im_start|>hi 42<|im_end|><|endoftext|> x"
    ids = theirs(text)["input_ids"]
    assert ours.encode(text) == ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
