"""shared.tokenizer: byte tokenizer, HF tokenizer.json wrapper, chat templates,
and streaming decode that never splits a UTF-8 character."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from shared.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDecoder,
    Tokenizer,
    load_tokenizer,
)

SAMPLES = ["hello", "héllo wörld", "日本語のテキスト", "emoji 🙂👍🏽 mix", "a\u0301 ç ß ✓", ""]


def stream(tok: Tokenizer, ids: list[int], context: list[int] | None = None) -> list[str]:
    dec = IncrementalDecoder(tok, context or [])
    deltas = [dec.push([i]) for i in ids]
    deltas.append(dec.flush())
    assert dec.text == "".join(deltas)
    return deltas


def make_hf_dir(tmp_path: Path, chat_template: str | None) -> Path:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(SAMPLES * 20 + ["the quick brown fox jumps"] * 20, trainer)
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    cfg: dict[str, object] = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    return tmp_path


# ---------- byte tokenizer ----------


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == text
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert max(ids, default=0) < tok.vocab_size == 259


def test_byte_decode_replaces_invalid_bytes() -> None:
    assert ByteTokenizer().decode([0xFF, ord("a")]) == "\ufffda"


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_stream_never_splits_a_character(text: str) -> None:
    tok = ByteTokenizer()
    deltas = stream(tok, tok.encode(text, add_special_tokens=False), context=tok.encode("ça: "))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # a 4-byte emoji arrives as one delta, never as pieces
    assert all(d in text for d in deltas)


def test_stream_flushes_incomplete_tail() -> None:
    tok = ByteTokenizer()
    dec = IncrementalDecoder(tok)
    assert dec.push(list("é".encode())[:1]) == ""
    assert dec.flush() == "\ufffd"


def test_stream_keeps_going_after_invalid_byte() -> None:
    tok = ByteTokenizer()
    assert "".join(stream(tok, [0xFF, ord("o"), ord("k")])) == "\ufffdok"


def test_default_chat_template() -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert ByteTokenizer().apply_chat_template(msgs) == (
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    )
    assert ByteTokenizer().apply_chat_template(msgs[:1], add_generation_prompt=False) == (
        "<|system|>\nbe brief\n"
    )
    with pytest.raises(ValueError, match="role"):
        ByteTokenizer().apply_chat_template([{"content": "x"}])


def test_load_without_tokenizer_json_is_bytes(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert load_tokenizer(tmp_path).stop_token_ids == [257]


def test_bytes_stop_on_every_config_eos_id(tmp_path: Path) -> None:
    """A model dir without tokenizer.json (e.g. a bare transformers checkpoint) stops on
    the eos ids of generation_config.json and config.json, int or list, and nothing else."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 512}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 2]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert tok.stop_token_ids == [9, 2] and tok.vocab_size == 512
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None, "vocab_size": 64}))
    assert load_tokenizer(tmp_path).stop_token_ids == []  # transformers stops on none either


# ---------- HF tokenizer ----------


def test_hf_tokenizer_without_any_eos_loads_and_stops_on_none(tmp_path: Path) -> None:
    """A tokenizer naming no eos token beside a config with ``eos_token_id: null`` (what
    transformers' ``Qwen2Config()`` writes): the model still serves, stopping only on
    max_tokens / stop_token_ids as transformers' ``generate`` does."""
    make_hf_dir(tmp_path, None)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.stop_token_ids == [] and tok.eos_token_id is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    assert load_tokenizer(tmp_path).stop_token_ids == [7, 3]


def test_hf_tokenizer_ids_round_trip_and_stream(tmp_path: Path) -> None:
    tok = load_tokenizer(make_hf_dir(tmp_path, None))
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.stop_token_ids == [1, 5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert load_tokenizer(tmp_path).stop_token_ids == [1, 7, 5]
    assert tok.vocab_size > 256
    rng = random.Random(0)
    for text in SAMPLES + ["the quick 🙂 fox"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids + [tok.eos_token_id]) == text
        deltas = stream(tok, ids[1:], context=tok.encode("x ")[1:])
        assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
        # chunks of several ids at a time also reassemble exactly
        dec, out, i = IncrementalDecoder(tok), [], 0
        while i < len(ids):
            step = rng.randint(1, 3)
            out.append(dec.push(ids[i : i + step]))
            i += step
        assert "".join(out) + dec.flush() == text
    # the emoji is split over byte-level tokens: the stream must have held text back
    assert "" in stream(tok, tok.encode("the quick 🙂 fox", add_special_tokens=False))[:-1]


def test_hf_chat_template_rendered_with_jinja(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    tok = load_tokenizer(make_hf_dir(tmp_path, template))
    text = tok.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert text == "<s>[user] héllo\n[assistant] "


def test_hf_chat_template_missing_falls_back_to_default(tmp_path: Path) -> None:
    tok = load_tokenizer(make_hf_dir(tmp_path, None))
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == (
        "<|user|>\nq\n<|assistant|>\n"
    )


def test_hf_chat_template_raise_exception(tmp_path: Path) -> None:
    tok = load_tokenizer(make_hf_dir(tmp_path, "{{ raise_exception('no system role') }}"))
    with pytest.raises(ValueError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_special_tokens_are_skipped_unless_asked_for(tmp_path: Path) -> None:
    """vLLM's ``skip_special_tokens`` (default true): false writes them in the text, for the
    HF tokenizer and the byte one alike, streamed as whole."""
    hf = load_tokenizer(make_hf_dir(tmp_path, None))
    ids = [*hf.encode("hello"), hf.encode("</s>", add_special_tokens=False)[0]]
    assert hf.decode(ids) == "hello"
    assert hf.decode(ids, skip_special_tokens=False) == "<s>hello</s>"
    dec = IncrementalDecoder(hf, [], skip_special_tokens=False)
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == "<s>hello</s>"
    byte = ByteTokenizer()
    ids = [256, *"é!".encode(), 257]
    assert byte.decode(ids) == "é!" and byte.decode(ids, False) == "<bos>é!<eos>"
    dec = IncrementalDecoder(byte, [], skip_special_tokens=False)
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == "<bos>é!<eos>"
