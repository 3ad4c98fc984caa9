"""Chat templates rendered exactly as transformers' ``apply_chat_template`` renders them.

The environment is transformers' own (``transformers.utils.chat_template_utils``, 4.4x
and 5.x): a jinja2 ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation %}`` block tag
(rendered as its body: we never ask for an assistant-token mask), a ``tojson`` filter that
does not HTML-escape and takes ``ensure_ascii`` / ``indent`` / ``separators`` /
``sort_keys``, and the globals ``raise_exception``, ``strftime_now``, a safe ``dict`` and a
``namespace`` that refuses underscore names. The template sees what transformers passes:
``messages``, ``tools`` and ``documents`` (None), ``add_generation_prompt``, every named
special token the tokenizer has (``bos_token``, ``eos_token``, ...), then the caller's
extra keyword arguments (``chat_template_kwargs``: ``enable_thinking``, ``date_string``).
A message's reasoning given as ``thinking`` or ``reasoning`` is also offered as
``reasoning_content`` (and the other way round), as transformers does.

A template is compiled once (:func:`compile_template` caches by source) and is pure
CPU work: the API renders it on a worker thread, never on its event loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the arguments the renderer sets itself; chat_template_kwargs may not name them
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template did not compile, or refused the chat (``raise_exception``)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text
    with it for its token mask; the rendered text is the block's body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; transformers' does not
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` refusing underscore attributes (no CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source: a tokenizer compiles its template once)."""
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def _alias_reasoning(messages: list[Any]) -> list[Any]:
    out = []
    for message in messages:
        if isinstance(message, Mapping):
            reasoning = next(
                (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
            )
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """``source`` rendered for ``messages`` as ``tokenizer.apply_chat_template(messages,
    tokenize=False, add_generation_prompt=..., continue_final_message=..., **kwargs)``
    renders it; a template that refuses the chat raises :class:`ChatTemplateError`."""
    extra = dict(kwargs or {})
    clash = sorted(RESERVED & set(extra))
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
    tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be objects, got {message!r}")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt exclude each other"
        )
    try:
        text = compile_template(source).render(
            messages=_alias_reasoning(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**tokens, **extra},  # the caller's kwargs override special tokens
        )
    except Exception as e:  # noqa: BLE001 - untrusted template code: any failure refuses the chat
        raise ChatTemplateError(f"chat template: {e}") from None
    return cut_after_final_message(text, messages) if continue_final_message else text


def cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` ending with the last message's content, so that generation continues that
    message (what transformers does for ``continue_final_message``): everything the
    template wrote after the content's last occurrence (an end-of-turn token) is dropped.
    Where the template trimmed the content's trailing spaces, the text ends at the trimmed
    content."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):  # content parts: the last text part is what continues
        texts = [p["text"] for p in final if isinstance(p, Mapping) and "text" in p]
        final = texts[-1] if texts else None
    if not isinstance(final, str):
        raise ChatTemplateError("continue_final_message: the final message has no text")
    core = final.strip()
    at = text.rfind(core)
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not write the final message's text"
        )
    kept = final.lstrip()
    return text[: at + (len(kept) if text[at : at + len(kept)] == kept else len(core))]
