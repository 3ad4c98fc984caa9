"""Request bodies of the OpenAI routes as msgspec Structs: the types and ranges are the
check. Unknown fields are tolerated (OpenAI clients send more than we use).

Limits not expressible here (``n`` <= ``ROLLBUS_MAX_N``, token ids within the
vocabulary, prompt + ``max_tokens`` within the context length) are checked by the
route once the model is known. Every limit is listed in the README ("Limits").
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from shared.messages import (
    FLOAT_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    TOKEN_LIMIT,
)

MAX_BAD_WORD_LEN = 1024  # characters per bad word
MAX_STOP = 64  # stop strings per request
MAX_STOP_LEN = 1024  # characters per stop string
MAX_MESSAGES = 4096  # chat messages per request
MAX_JSON_DEPTH = 64  # nesting of any request body
MAX_TEMPLATE_KWARGS = 64  # entries of chat_template_kwargs

Count = Annotated[int, Meta(ge=1, le=TOKEN_LIMIT)]
TokenId = Annotated[int, Meta(ge=0, le=TOKEN_LIMIT)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LEN)]
Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Bias = Annotated[float, Meta(ge=-MAX_BIAS, le=MAX_BIAS)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    # vLLM's and FastDeploy's: the usage so far on every chunk of the stream
    continuous_usage_stats: bool | None = None


class Sampling(msgspec.Struct, kw_only=True):
    """What both routes accept. ``None`` = not given (OpenAI clients send nulls)."""

    model: str | None = None
    max_tokens: Count | None = None
    # chat's name for max_tokens (it wins); honoured on /v1/completions too, never ignored
    max_completion_tokens: Count | None = None
    n: Count | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=FLOAT_MAX)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=TOKEN_LIMIT)] | None = None  # -1 and 0: off
    seed: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's: the stop string ends the text
    skip_special_tokens: bool | None = None  # vLLM's; false: special tokens are in the text
    # vLLM's: keep only the last k prompt tokens (-1: the context length)
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=TOKEN_LIMIT)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprob tokens as "token_id:<id>"
    # applied on the rank: added to the logits / stop ids masked until then / vLLM's
    # penalties (README "Limits")
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=TOKEN_LIMIT)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=FLOAT_MAX)] | None = None
    # vLLM's, applied on rank 0 (README "Limits"): min_p after temperature; only these
    # ids may be sampled (the route checks them against the vocabulary)
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    allowed_token_ids: (
        Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    # vLLM's: words never written (tokenized by the route, with and without a leading space)
    bad_words: (
        Annotated[
            list[Annotated[str, Meta(max_length=MAX_BAD_WORD_LEN)]],
            Meta(max_length=MAX_BAD_WORDS // 2),
        ]
        | None
    ) = None
    user: Annotated[str, Meta(max_length=1024)] | None = None
    # OpenAI's (completions) and vLLM's (both): only best_of == n is served (the route)
    best_of: Annotated[int, Meta(ge=1, le=TOKEN_LIMIT)] | None = None
    # rollbus: this request's staleness bound (README "Staleness"); the stricter of it and
    # ROLLBUS_MAX_STALENESS applies
    max_staleness: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None


class CompletionRequest(Sampling, kw_only=True):
    # a string, a list of strings, token ids, or a list of token-id lists (each a prompt;
    # their number times n is bounded by ROLLBUS_MAX_N)
    prompt: str | list[str | TokenId | list[TokenId]]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # OpenAI's, not supported: a value that would change the answer is a 400 (the route)
    echo: bool | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: str | list[ContentPart] | None = None


class ChatRequest(Sampling, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # vLLM's: extra variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: Annotated[dict[str, Any], Meta(max_length=MAX_TEMPLATE_KWARGS)] | None = (
        None
    )
    # vLLM's: render without the assistant header (default: with it, unless continuing)
    add_generation_prompt: bool | None = None
    # vLLM's: the prompt ends inside the final (assistant) message, which the model continues
    continue_final_message: bool | None = None


def _off(value: Any) -> bool:
    return not value  # absent, null, false, 0, "", [] or {}


# Fields of OpenAI's or vLLM's API that rollbus does not implement, with the values that
# ask for nothing (OpenAI clients send them): any other value would change the answer, so
# it is refused (400 naming the field), never silently ignored. Other unknown fields
# (``user``, ``metadata``, ``priority``, ...) change nothing and are ignored.
UNSUPPORTED: dict[str, Any] = {
    "prompt_logprobs": lambda v: v is None,
    "use_beam_search": _off,
    "response_format": lambda v: _off(v) or (isinstance(v, dict) and v.get("type") == "text"),
    "guided_json": _off,
    "guided_regex": _off,
    "guided_choice": _off,
    "guided_grammar": _off,
    "structured_outputs": _off,
}
UNSUPPORTED_CHAT: dict[str, Any] = {
    "tools": _off,
    "functions": _off,
    "tool_choice": lambda v: v is None or v in ("none", "auto"),
    "function_call": lambda v: v is None or v in ("none", "auto"),
    "documents": _off,
    "chat_template": _off,
    "echo": _off,
}


def unsupported(body: dict[str, Any], chat: bool) -> tuple[str, str] | None:
    """``(param, message)`` of the first field asking for what rollbus does not do."""
    table = {**UNSUPPORTED, **UNSUPPORTED_CHAT} if chat else UNSUPPORTED
    for name, off in table.items():
        if name in body and not off(body[name]):
            return name, f"'{name}' is not supported (value {json_text(body[name])})"
    if chat:
        for i, msg in enumerate(body.get("messages") or ()):
            parts = msg.get("content") if isinstance(msg, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    where = f"messages[{i}].content[{j}].type"
                    return where, f"'{where}': only text parts are supported, not {kind[:64]!r}"
                if kind == "text" and not isinstance(part.get("text"), str):
                    # OpenAI requires it; a template would render the part as nothing
                    where = f"messages[{i}].content[{j}].text"
                    return where, f"'{where}': a text part needs its text (a string)"
    return None


def json_text(value: Any, limit: int = 64) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def convert(body: Any, kind: type[Sampling]) -> Sampling:
    """The body as ``kind``; raises ``msgspec.ValidationError`` naming the field."""
    return msgspec.convert(body, type=kind, strict=True)
