"""Tokenizers: a byte-level one for the default tiny model and a wrapper over a HF
``tokenizer.json``, behind one small protocol; plus streaming (incremental) decode.

Chat templates render as transformers renders them (:mod:`shared.chat_template`).

Special tokens: ``encode(text)`` adds them the way the tokenizer's own post-processor
does (HF default ``add_special_tokens=True``; the byte tokenizer prepends ``<bos>``).
Text produced by ``apply_chat_template`` already carries what the template puts in, so
encode it with ``add_special_tokens=False``. ``decode`` always skips special tokens.

Streaming: :class:`IncrementalDecoder` (built on :func:`decode_incremental`) re-decodes a
short window of recent ids and withholds text while it ends in U+FFFD, so a multi-byte
UTF-8 character split across tokens is emitted only once complete, and
sentencepiece-style leading spaces survive because the window starts before the new ids.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers

from shared import chat_template

DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
"""Per-message format used when a model ships no chat template; the rendered chat ends
with ``DEFAULT_GENERATION_PROMPT`` when a reply is wanted. Example for one user turn:
``"<|user|>\\nhi\\n<|assistant|>\\n"``."""
DEFAULT_GENERATION_PROMPT = "<|assistant|>\n"

_REPLACEMENT = "\ufffd"
_CONTEXT_IDS = 6  # prompt ids kept as decode context so the first output token's spacing is right


class Tokenizer(Protocol):
    @property
    def eos_token_id(self) -> int | None: ...  # None: the model names no eos id

    bos_token_id: int | None
    stop_token_ids: list[int]  # every id that ends generation (eos first)
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str: ...


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return str(content)


def render_default_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    out = []
    for m in messages:
        if "role" not in m:
            raise ValueError("every chat message needs a 'role'")
        out.append(DEFAULT_CHAT_TEMPLATE.format(role=m["role"], content=_content_text(m)))
    if add_generation_prompt:
        out.append(DEFAULT_GENERATION_PROMPT)
    return "".join(out)


class _ChatTemplating:
    """``apply_chat_template`` for both tokenizers: the model's template when it has one
    (``chat_template``), else the default format."""

    chat_template: str | None = None
    special_tokens: Mapping[str, str | None] = {}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The chat as transformers' ``apply_chat_template(..., tokenize=False)`` renders
        it (:mod:`shared.chat_template`); the default format when the model has no
        template. CPU work: call it off the event loop."""
        if self.chat_template is None:
            text = render_default_chat(messages, add_generation_prompt)
            if continue_final_message:
                return chat_template.cut_after_final_message(text, messages)
            return text
        return chat_template.render(
            self.chat_template,
            messages,
            add_generation_prompt,
            self.special_tokens,
            chat_template_kwargs,
            continue_final_message,
        )


_BYTE_SPECIALS = {256: "<bos>", 257: "<eos>", 258: "<pad>"}


class ByteTokenizer(_ChatTemplating):
    """ids 0..255 are raw UTF-8 bytes; 256 <bos>, 257 <eos>, 258 <pad>."""

    bos_token_id: int | None = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    vocab_size: int = 259

    def __init__(
        self, stop_token_ids: Sequence[int] | None = None, vocab_size: int | None = None
    ) -> None:
        # A model dir without tokenizer.json names its own eos ids (maybe none) and
        # vocabulary in config.json; the byte tokenizer's <eos> is the default.
        self.stop_token_ids = (
            [self.eos_token_id] if stop_token_ids is None else list(stop_token_ids)
        )
        if vocab_size:
            self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [256, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        # each run of bytes decoded alone, the special ids written as their names
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(_BYTE_SPECIALS.get(i, ""))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as "<s>" or {"content": "<s>", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class HFTokenizer(_ChatTemplating):
    """A HF fast tokenizer (``tokenizer.json``) with ids and chat template read from
    ``tokenizer_config.json``, ``generation_config.json`` and ``config.json``."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        tcfg = _read_json(model_dir / "tokenizer_config.json")
        smap = _read_json(model_dir / "special_tokens_map.json")
        mcfg = _read_json(model_dir / "config.json")
        gcfg = _read_json(model_dir / "generation_config.json")
        raw = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
        cls = transformers_class(tcfg, mcfg, raw)
        if cls == "LlamaTokenizer":
            self._tok = _llama_tokenizer(raw, tcfg)
        elif cls == "Qwen2Tokenizer":
            self._tok = _qwen2_tokenizer(raw)
            _qwen2_pipeline(self._tok, tcfg)
        else:
            self._tok = tokenizers.Tokenizer.from_str(raw)
        _mark_special(self._tok, tcfg, smap)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # the tokenizer's own eos as transformers (so vLLM) has it: special_tokens_map.json
        # over tokenizer_config.json (an older repo names it there only); the one eos id
        # whose stop is unnamed (stop_reason null), generation_config.json's others named
        self.eos_token, self.bos_token = (
            _token_text(smap.get("eos_token", tcfg.get("eos_token"))),
            _token_text(tcfg.get("bos_token")),
        )
        eos = (
            [self._id_of(self.eos_token)]
            + _ids(gcfg.get("eos_token_id"))
            + _ids(mcfg.get("eos_token_id"))
        )
        # a model naming no eos id anywhere (transformers' Qwen2Config() has none) stops
        # only on max_tokens / stop_token_ids, as transformers' generate does
        stops = list(dict.fromkeys(i for i in eos if i is not None))
        self.eos_token_id: int | None = stops[0] if stops else None
        self.stop_token_ids: list[int] = stops
        bos = [self._id_of(self.bos_token)] + _ids(mcfg.get("bos_token_id"))
        self.bos_token_id: int | None = next((i for i in bos if i is not None), None)
        # every named special token, as transformers hands them to a chat template
        self.special_tokens: dict[str, str | None] = {
            k: _token_text(tcfg.get(k, smap.get(k))) for k in chat_template.SPECIAL_TOKENS
        }
        self.chat_template = self._find_template(tcfg)
        if self.chat_template is not None:
            # compiled once, here; a template that does not compile fails each chat request
            # with its error (400) but leaves /v1/completions serving
            with contextlib.suppress(chat_template.ChatTemplateError):
                chat_template.compile_template(self.chat_template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _find_template(self, tcfg: dict[str, Any]) -> str | None:
        # as transformers: a chat_template.jinja file wins over tokenizer_config.json
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


# transformers' Qwen2Tokenizer pre-tokenizer (models/qwen2/tokenization_qwen2.py)
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def transformers_class(
    tcfg: Mapping[str, Any], mcfg: Mapping[str, Any], tokenizer_json: str = ""
) -> str | None:
    """The tokenizer class transformers 5's ``AutoTokenizer`` picks for a model dir, as far
    as it changes the ids: ``"Qwen2Tokenizer"`` for a ``qwen2`` model whatever its
    ``tokenizer_class`` says, and for a ``qwen3`` one naming none (or for any naming it);
    ``"LlamaTokenizer"`` where it is named and ``tokenizer.json`` is not byte-level (a
    byte-level one, as Llama-3's, is loaded as it is); else the named class (``None``:
    none named)."""
    hub = tcfg.get("tokenizer_class") or mcfg.get("tokenizer_class")
    hub = hub.removesuffix("Fast") if isinstance(hub, str) else None
    model_type = mcfg.get("model_type")
    if tcfg.get("auto_map") is not None:
        return hub  # remote code: not ours to emulate
    if model_type == "qwen2" or (model_type == "qwen3" and hub is None):
        return "Qwen2Tokenizer"
    if hub == "LlamaTokenizer":
        try:
            spec = json.loads(tokenizer_json) if tokenizer_json else {}
        except ValueError:
            spec = {}
        parts = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
        model = spec.get("model") or {}
        # ernie4_5 is one of transformers' "incorrect hub class" model types
        if '"ByteLevel"' in parts or model.get("type") != "BPE" or model_type == "ernie4_5":
            return "TokenizersBackend"
    return hub


def _llama_tokenizer(tokenizer_json: str, tcfg: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """What transformers' ``LlamaTokenizer`` builds around a (non byte-level) BPE
    ``tokenizer.json``: its vocabulary, merges, added tokens and post-processor, with its
    own BPE flags (byte fallback, fused unknowns), no normalizer, a Metaspace
    pre-tokenizer whose prefix scheme follows ``add_prefix_space`` / ``legacy``
    (``first`` by default: no ``▁`` after a special token) and its decoder."""
    from tokenizers import decoders, pre_tokenizers

    spec = json.loads(tokenizer_json)
    spec["model"].update(fuse_unk=True, byte_fallback=True, dropout=None, unk_token=None)
    spec["normalizer"] = None
    tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    prefix = tcfg.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if tcfg.get("legacy", False) else "first") if prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _mark_special(
    tok: tokenizers.Tokenizer, tcfg: Mapping[str, Any], smap: Mapping[str, Any]
) -> None:
    """The special tokens ``tokenizer_config.json`` names (``bos_token`` … and
    ``additional_special_tokens``) become special added tokens, as transformers adds them:
    a name that ``tokenizer.json`` keeps as a plain vocabulary entry is then split out of
    text whole and skipped when decoding, as there. One already added keeps its flags but
    is made special (transformers skips every named one in decode, special or not)."""
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    names: list[str | None] = [
        _token_text(tcfg.get(k, smap.get(k))) for k in chat_template.SPECIAL_TOKENS
    ]
    extra = tcfg.get("additional_special_tokens", smap.get("additional_special_tokens"))
    if isinstance(extra, list):
        names += [_token_text(t) for t in extra]
    new = []
    for n in dict.fromkeys(names):
        old = added.get(n) if n else None
        if n and old is None:
            new.append(tokenizers.AddedToken(n, special=True))
        elif old is not None and not old.special:  # re-adding it updates its flags
            new.append(
                tokenizers.AddedToken(
                    n,
                    single_word=old.single_word,
                    lstrip=old.lstrip,
                    rstrip=old.rstrip,
                    normalized=old.normalized,
                    special=True,
                )
            )
    if new:
        tok.add_special_tokens(new)


def _qwen2_tokenizer(tokenizer_json: str) -> tokenizers.Tokenizer:
    """The model transformers' ``Qwen2Tokenizer`` builds from a ``tokenizer.json``: a BPE
    over the file's vocabulary and merges (none for a WordLevel / WordPiece / Unigram
    file) with its own flags — no unknown token (a piece outside the vocabulary is
    dropped), no byte fallback — whatever model the file names, so a WordLevel
    ``tokenizer.json`` beside a ``qwen2`` config encodes as transformers encodes it."""
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids in list order
        vocab = {(v[0] if isinstance(v, list) else v): i for i, v in enumerate(vocab)}
    merges = (model.get("merges") or []) if model.get("type") == "BPE" else []
    spec["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": bool(model.get("ignore_merges", False)),
        "vocab": vocab,
        "merges": merges,
    }
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def _qwen2_pipeline(tok: tokenizers.Tokenizer, tcfg: Mapping[str, Any]) -> None:
    """What transformers' ``Qwen2Tokenizer`` does with a ``tokenizer.json``: it keeps the
    BPE vocabulary, merges, added tokens and post-processor and builds the rest itself —
    NFC, the Qwen split regex (digits one by one), byte-level without its own regex — so a
    ``tokenizer.json`` with another pre-tokenizer encodes as transformers encodes it (a
    real Qwen ``tokenizer.json`` already holds this pipeline)."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(
                add_prefix_space=bool(tcfg.get("add_prefix_space")), use_regex=False
            ),
        ]
    )
    tok.decoder = decoders.ByteLevel()  # the post-processor stays tokenizer.json's, as there


def config_eos_ids(model_dir: Path) -> list[int]:
    """Every eos id of ``generation_config.json`` and ``config.json`` (each an int or a
    list), in that order, without repeats: generation stops on any of them."""
    gcfg = _read_json(Path(model_dir) / "generation_config.json")
    mcfg = _read_json(Path(model_dir) / "config.json")
    return list(dict.fromkeys(_ids(gcfg.get("eos_token_id")) + _ids(mcfg.get("eos_token_id"))))


def load_tokenizer(model_dir: Path) -> Tokenizer:
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").exists():
        return HFTokenizer(model_dir)
    if not (model_dir / "config.json").is_file():
        return ByteTokenizer()
    vocab = _read_json(model_dir / "config.json").get("vocab_size")
    return ByteTokenizer(config_eos_ids(model_dir), vocab if isinstance(vocab, int) else None)


def decode_incremental(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    prefix_offset: int,
    read_offset: int,
    final: bool = False,
    skip_special_tokens: bool = True,
) -> tuple[str, int, int]:
    """New text for ``ids[read_offset:]`` given that everything before ``read_offset`` has
    been emitted; returns ``(text, prefix_offset, read_offset)`` to pass next time.

    ``ids[prefix_offset:read_offset]`` is decode context only. Text ending in U+FFFD is an
    incomplete UTF-8 sequence and is held back until more ids arrive (or ``final``)."""
    prefix_text = tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens)
    new_text = tokenizer.decode(ids[prefix_offset:], skip_special_tokens)
    if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT)):
        return new_text[len(prefix_text) :], read_offset, len(ids)
    return "", prefix_offset, read_offset


class IncrementalDecoder:
    """Per-request streaming detokenizer: ``push`` new ids, get the text safe to emit."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,  # false: special tokens are written as text
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context_ids[-_CONTEXT_IDS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Emit whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        delta, self.prefix_offset, self.read_offset = decode_incremental(
            self.tokenizer,
            self.ids,
            self.prefix_offset,
            self.read_offset,
            final,
            self.skip_special_tokens,
        )
        self.text += delta
        return delta
