"""Every message on the bus, as msgspec Structs, with their encoders. Pure: no I/O.

Control and event messages are JSON so the ``nats`` CLI can speak them; the hot path
(step commands, token chunks) is msgpack through the same Structs.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import time
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from shared import jsonkeys
from shared.errors import BAD_REQUEST, ControlError

T = TypeVar("T")

# Limits of the generation contract, checked by the API and again by the engine
# (``rollbus.<i>.gen`` is reachable over raw NATS too). See README "Limits".
MAX_REQUEST_ID_LEN = 256
MAX_STOP_TOKEN_IDS = 256  # client-given; the API adds the tokenizer's end-of-sequence ids
MAX_VERSION_LEN = 256
MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's maximum)
MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias
MAX_BIAS = 100.0  # |value| of one logit_bias entry (OpenAI's range)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_ALLOWED_TOKEN_IDS = 4096  # a request's allowed_token_ids (they travel with every step)
MAX_BAD_WORDS = 256  # a request's bad_words token sequences (each word gives one or two)
MAX_BAD_WORD_TOKENS = 64  # tokens of one of them
FLOAT_MAX = sys.float_info.max  # ``le=FLOAT_MAX`` rejects inf; every bound rejects NaN
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_LIMIT = 2**31 - 1
MAX_STEP_ITERS = 32  # decode iterations of one step message (ROLLBUS_DECODE_STEPS' bound)

PauseMode = Literal["abort", "wait", "keep"]
SLEEP_TAGS = ("weight", "kv_cache")

# --------------------------------------------------------------------------- control


class ControlReply(msgspec.Struct, omit_defaults=False):
    """The body of every control reply, and of every control HTTP response."""

    request_id: str
    error_code: int = 200
    error_message: str = ""
    result: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error_code == 200


class PauseArgs(msgspec.Struct, forbid_unknown_fields=True):
    # ``{"mode": ""}`` is the default too, as ``?mode=`` is (see ``decode_args``)
    blank_absent: ClassVar[frozenset[str]] = frozenset({"mode"})

    mode: PauseMode = "abort"


class TagArgs(msgspec.Struct, forbid_unknown_fields=True):
    """``sleep`` / ``wakeup`` arguments; tags as a list or a comma-separated string."""

    tags: list[str] | str | None = None

    def tag_set(self) -> tuple[str, ...]:
        return parse_tags(self.tags)


class UpdateWeightsArgs(msgspec.Struct, forbid_unknown_fields=True):
    version: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_VERSION_LEN)] | None = None
    verify_checksum: bool | None = None  # None: verify wherever a manifest exists


class NoArgs(msgspec.Struct, forbid_unknown_fields=True):
    """Methods without arguments (``resume``, ``is_paused``, ``health``, ...): ``{}`` or
    an empty body; any field is a 400 naming it, as for every other control method."""


class StatusArgs(msgspec.Struct, forbid_unknown_fields=True):
    """``status`` arguments. ``fresh``: ask every rank now (two hops) instead of
    answering from the engine's view of the ranks (refreshed every ``RANK_REFRESH_S``)."""

    fresh: bool = False


MAX_ERROR_CHARS = 2048  # of an error message: a reply must fit the server's max_payload


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was: error messages echo
    what the client sent (a field name, a tag), and a reply larger than the server's
    ``max_payload`` could not be sent at all."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


def parse_tags(tags: list[str] | str | None) -> tuple[str, ...]:
    """Normalize sleep/wakeup tags; none means all. Unknown tag: ``ControlError(400)``."""
    if tags is None:
        return SLEEP_TAGS
    items = tags.split(",") if isinstance(tags, str) else list(tags)
    items = [t.strip() for t in items if t.strip()]
    if not items:
        return SLEEP_TAGS
    unknown = [t for t in items if t not in SLEEP_TAGS]
    if unknown:
        raise ControlError(
            BAD_REQUEST,
            clip(f"unknown tag(s) {unknown}: allowed tags are {list(SLEEP_TAGS)}"),
            {"param": "tags"},
        )
    return tuple(t for t in SLEEP_TAGS if t in items)


_AT = re.compile(r" - at `\$(.*)`$")
_MISSING = re.compile(r"^Object (?:missing required|contains unknown) field `([^`]*)`")


def error_param(err: msgspec.ValidationError) -> str | None:
    """The field a msgspec validation error names: ``$.temperature`` -> ``temperature``,
    ``$.messages[0].role`` -> ``messages[0].role``, a missing or unknown field by its name; a
    dict value (``$.logit_bias[...]``) is named by its dict; None for the document."""
    text = str(err)
    hit = _AT.search(text)
    path = hit.group(1).replace("[...]", "").lstrip(".") if hit else ""
    missing = _MISSING.match(text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def error_text(err: msgspec.ValidationError) -> str:
    """The message of a validation error without its ``- at `$...``` suffix."""
    return _AT.sub("", str(err))


def duplicate_key_error(path: str) -> ControlError:
    """The 400 for a JSON body that names a key twice (:mod:`shared.jsonkeys`)."""
    path = clip(path, 256)  # the client's to choose
    return ControlError(
        BAD_REQUEST,
        f"bad argument '{path}': given more than once in one JSON object (duplicate key)",
        {"param": path},
    )


def _nulls_absent(data: bytes, kind: type) -> bytes:
    """``data`` without the fields of ``kind`` given ``null`` (absent: their default, as
    OpenAI clients send unset fields), nor those its ``blank_absent`` names given ``""``.
    An unknown field stays, whatever its value: ``kind`` refuses it (400 naming it)."""
    if b"null" not in data and b'""' not in data:
        return data
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data  # the typed decode says what is wrong with it
    if not isinstance(doc, dict):
        return data
    fields = getattr(kind, "__struct_encode_fields__", ())
    blank = getattr(kind, "blank_absent", ())
    kept = {
        k: v
        for k, v in doc.items()
        if not ((v is None and k in fields) or (v == "" and k in blank))
    }
    return data if len(kept) == len(doc) else msgspec.json.encode(kept)


def decode_args(data: bytes, kind: type[T]) -> T:
    """Decode control arguments strictly; a wrong type or field, or a key given twice, is
    a 400 naming it (in the message and as ``result.param``). A known field given ``null``
    is absent (its default), over HTTP and NATS alike (README "Limits")."""
    if not data.strip():
        data = b"{}"
    if dup := jsonkeys.duplicate_in(data):
        raise duplicate_key_error(dup)
    data = _nulls_absent(data, kind)
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        param = error_param(e)
        if param:
            param = clip(param, 256)  # an unknown field's name is the client's to choose
        raise ControlError(
            BAD_REQUEST,
            clip(f"bad argument '{param}': {error_text(e)}" if param else f"bad arguments: {e}"),
            {"param": param or "body"},
        ) from None
    except msgspec.DecodeError as e:
        param = _unreadable_field(data)
        if param:
            raise ControlError(
                BAD_REQUEST,
                f"bad argument '{param}': not a finite number or not valid unicode",
                {"param": param},
            ) from None
        raise ControlError(BAD_REQUEST, f"body is not valid JSON: {e}", {"param": "body"}) from None
    except RecursionError:
        raise ControlError(BAD_REQUEST, "body nests too deeply", {"param": "body"}) from None


def _unreadable(value: Any) -> bool:
    if isinstance(value, float):
        return value != value or value in (float("inf"), float("-inf"))
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:  # a lone surrogate ("\ud800")
            return True
    return False


def _unreadable_field(data: bytes) -> str | None:
    """The field of a control body that Python's json reads but msgspec refuses to (NaN,
    Infinity, a lone surrogate: msgspec says "JSON is malformed" or even "Input data was
    truncated"), so that the 400 names it; None when the body is not JSON at all."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    for key, value in doc.items():
        if _unreadable(key) or _unreadable(value):
            return clip(key.encode("utf-8", "replace").decode(), 256)
        for i, item in enumerate(value if isinstance(value, list) else ()):
            if _unreadable(item):
                return clip(f"{key}[{i}]", 256)
    return None


# --------------------------------------------------------------------------- workers


class WorkerReply(msgspec.Struct):
    """One rank's answer to a ``worker.ctl.<method>`` scatter."""

    rank: int
    error_code: int = 200
    error_message: str = ""
    result: dict[str, Any] = msgspec.field(default_factory=dict)


class StageArgs(msgspec.Struct):
    """Phase one of an update: load and validate ``version`` into staging."""

    version: str
    verify_checksum: bool | None = None  # None: verify wherever a manifest exists
    strategy: str = "snapshot"
    update_id: str = ""


class CommitArgs(msgspec.Struct):
    version: str
    update_id: str = ""


class UpdateIdArgs(msgspec.Struct):
    """``finalize`` (free the previous weights) or ``rollback`` (swap them back)."""

    update_id: str


class SelfBenchArgs(msgspec.Struct):
    """Decode on the ranks alone (no bus per step): the in-process baseline of benchmarks."""

    batch: int = 16
    steps: int = 64
    prompt_len: int = 16
    prefill: bool = False  # time the prompts' prefill too (the first token comes from it)


# what a rank frees / restores; a rank refuses any other tag (400) like the engine does
WorkerTag = Literal["weight", "kv_cache"]


class SleepWorkerArgs(msgspec.Struct):
    tags: list[WorkerTag]
    shutdown_comm_group: bool = False


class WakeupWorkerArgs(msgspec.Struct):
    tags: list[WorkerTag]
    version: str
    strategy: str = "snapshot"


# --------------------------------------------------------------------------- generation
# msgpack on the wire (hot path); array_like keeps step messages small.


TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_LIMIT)]


class LogitBias(msgspec.Struct, array_like=True):
    """Added to the logits before temperature / top-k / top-p / greedy: ``values[i]`` to
    token ``ids[i]``. The engine also checks the ids against the vocabulary, that the two
    lists have one length and that no id repeats (field ``logit_bias``)."""

    ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_LOGIT_BIAS)]
    values: Annotated[
        list[Annotated[float, msgspec.Meta(ge=-MAX_BIAS, le=MAX_BIAS)]],
        msgspec.Meta(max_length=MAX_LOGIT_BIAS),
    ]


class Penalties(msgspec.Struct, array_like=True):
    """vLLM's penalties of one sample position, applied by rank 0 after ``logit_bias``:
    ``repetition`` over the ids in the prompt and the output so far (a positive logit
    divided by it, a negative one multiplied; 1 = off), then ``frequency`` times each id's
    count in the output and ``presence`` once per id in the output subtracted. The ids come
    from rank 0's record of the sequence (its rows carry ``history``); the first
    ``prompt_len`` positions are the prompt."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    prompt_len: int = 0


class Limits(msgspec.Struct, array_like=True):
    """vLLM's ``min_p`` and ``allowed_token_ids`` of one sample position, applied by rank 0:
    only ``allowed`` ids may be sampled (the others' logits -inf, with the bias and the
    ban; None = all), and after temperature a token whose probability is below ``min_p``
    times the most likely one's is dropped (before top-k / top-p, as vLLM's sampler);
    ``bad_words`` below."""

    min_p: float = 0.0
    allowed: list[int] | None = None
    # vLLM's bad_words of more than one token: the last token of each is banned when the
    # output ends with the others. ``tail``: the output's last tokens the engine has (at
    # most the longest word's length - 1); rank 0 appends the one a step in flight
    # sampled (the row's ``prev``). Single-token words are in the spec's ``ban``.
    bad_words: list[list[int]] | None = None
    tail: list[int] | None = None


class SamplingSpec(msgspec.Struct, array_like=True):
    """How rank 0 samples one sequence's next token."""

    seq_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    salt: int = 0  # the choice index: seeded choices of one request differ, yet reproduce
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives to report at this position (0: none)
    # last, and None unless asked: one nil byte per spec; older rows (without it) decode
    logit_bias: LogitBias | None = None
    # ids that may not be sampled here (min_tokens: the stop ids before the minimum)
    ban: list[int] | None = None
    penalties: Penalties | None = None  # None unless the request has one (one nil byte)
    limits: Limits | None = None  # None unless the request has min_p / allowed_token_ids


class GenRequest(msgspec.Struct, forbid_unknown_fields=True):
    """API -> engine on ``rollbus.<i>.gen``; chunks stream back to the reply inbox.

    The constraints make decoding the check: a message out of range (NaN temperature,
    negative token id, ...) or with an unknown field (a raw client's typo, ignored it
    would change nothing) is refused with a 400 naming the field, before it is queued.
    ``n`` and the token ids are further bounded by the engine (``ROLLBUS_MAX_N``, the
    vocabulary, the context length)."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=TOKEN_LIMIT)]
    n: Annotated[int, msgspec.Meta(ge=1, le=TOKEN_LIMIT)] = 1
    temperature: Annotated[float, msgspec.Meta(ge=0, le=FLOAT_MAX)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=TOKEN_LIMIT)] = 0
    seed: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS + 16)] = (
        msgspec.field(default_factory=list)
    )
    logit_bias: LogitBias | None = None  # OpenAI's logit_bias as two lists; None = none
    # vLLM's: stop_token_ids cannot be sampled before this many output tokens (<= max_tokens)
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=TOKEN_LIMIT)] = 0
    # OpenAI's / vLLM's penalties (see Penalties); the defaults are off
    presence_penalty: Annotated[float, msgspec.Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=FLOAT_MAX)] = 1.0
    # vLLM's (see Limits): 0 = off; None = every id (not empty; ids within the vocabulary)
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    allowed_token_ids: (
        Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]
        | None
    ) = None
    # vLLM's bad_words as token sequences (the API tokenizes them): a single id is never
    # sampled; a longer one's last id is not sampled right after the others in the output
    bad_words: (
        Annotated[
            list[
                Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]
            ],
            msgspec.Meta(max_length=MAX_BAD_WORDS),
        ]
        | None
    ) = None
    # the request's own staleness bound (versions behind the newest announced); the
    # stricter of it and ROLLBUS_MAX_STALENESS applies; None = the setting's
    max_staleness: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None
    # the sender's bus takes batched stream replies (shared.bus): this request's chunks
    # may come in one message per step with those of other requests of the same inbox
    batch: bool = False
    # nobody reads the tokens before the end (the API: not streamed, no stop strings):
    # the engine may hold them and send every few steps; the first and the last at once
    coalesce: bool = False
    # requests the sender holds besides this one, not sent yet (a burst under way): an
    # idle engine waits for them so that they share the first step (ROLLBUS_ADMIT_WAIT_MS)
    more: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] = 0


class VersionSpan(msgspec.Struct, array_like=True):
    """Output tokens ``[start, end)`` of a choice were generated with ``version``."""

    version: str
    start: int
    end: int


class TopLogprobs(msgspec.Struct, array_like=True):
    """The most likely tokens at one sampled position: ids (most likely first) and their
    logprobs packed as little-endian float32, 4 bytes each (compact on the hot path)."""

    ids: list[int]
    packed: bytes = b""

    @classmethod
    def of(cls, ids: list[int], logprobs: list[float]) -> TopLogprobs:
        return cls(ids, struct.pack(f"<{len(logprobs)}f", *logprobs))

    @property
    def logprobs(self) -> list[float]:
        if len(self.packed) != 4 * len(self.ids):
            raise ValueError(f"{len(self.ids)} top ids but {len(self.packed)} bytes of logprobs")
        return list(struct.unpack(f"<{len(self.ids)}f", self.packed))


class GenChunk(msgspec.Struct):
    """Engine -> API: new tokens of choice ``index``; ``finish_reason`` set on the last."""

    request_id: str
    index: int = 0
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] | None = None
    version: str = ""
    finish_reason: str | None = None
    spans: list[VersionSpan] | None = None
    error_code: int = 0
    error_message: str = ""
    heartbeat: bool = False  # also the engine's "queued" acknowledgement, sent first
    error_param: str = ""  # the request field an error_code 400 is about
    top: list[TopLogprobs] | None = None  # per token, when the request asked top_logprobs


class GenCancel(msgspec.Struct):
    request_id: str


class StepRow(msgspec.Struct, array_like=True):
    """One sequence's part of a step: new tokens from ``start_pos``, its block table, and
    the sequences to sample from its last position (empty for a mid-prefill chunk).

    ``prev``: one more new token follows ``token_ids`` — the one the ranks sampled for
    this sequence in the step just before (kept because that step said ``keep``), which
    the engine had not received when it sent this one (pipelined steps).

    ``history``: rank 0 records the sequence's tokens (every row of it has the flag, the
    first from position 0) for its sample specs' ``penalties``."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: list[SamplingSpec]
    prev: bool = False
    history: bool = False

    @property
    def num_new(self) -> int:
        return len(self.token_ids) + self.prev


class StepRequest(msgspec.Struct, array_like=True):
    step: int
    rows: list[StepRow]
    copies: list[tuple[int, int]] = msgspec.field(default_factory=list)  # KV block src->dst
    finished: list[int] = msgspec.field(default_factory=list)  # seq ids rank 0 may forget
    version: str = ""  # the engine's weight version: a rank serving another refuses the step
    keep: bool = False  # every rank keeps the tokens sampled here: the next step may use them
    # decode iterations (1..MAX_STEP_ITERS): each row is one decode row (one token, one
    # sample spec of its own sequence); iteration i + 1 feeds every row the token
    # iteration i sampled for it. The reply's lists hold iteration 0's samples, then
    # iteration 1's, ...; ``keep`` keeps the last iteration's
    iters: int = 1


class StepReply(msgspec.Struct, array_like=True):
    """Rank 0's answer: one (seq_id, token, logprob) per sampling spec, in order (a step
    of ``iters`` > 1: per spec and iteration, iteration by iteration).

    ``error`` fails the whole step; ``failed`` names sequences whose sampling alone
    failed (``(seq_id, code, why)``): only their requests end, the others go on.
    ``top`` is empty unless a spec asked for ``top_logprobs``; then it holds one entry
    per sampled token (empty ids where none was asked)."""

    step: int
    seq_ids: list[int]
    tokens: list[int]
    logprobs: list[float]
    error: str = ""
    seconds: float = 0.0
    failed: list[tuple[int, int, str]] = msgspec.field(default_factory=list)
    top: list[TopLogprobs] = msgspec.field(default_factory=list)


# --------------------------------------------------------------------------- events


class Event(msgspec.Struct):
    """One audit-log entry on ``rollbus.<i>.events.<kind>``."""

    kind: str
    instance: str
    time: float = msgspec.field(default_factory=time.time)
    request_id: str = ""
    actor: str = ""
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class VersionPublished(msgspec.Struct):
    """The trainer's announcement on ``rollbus.ckpt.<model>.published``."""

    model: str
    version: str
    tp: int
    total_bytes: int = 0
    time: float = msgspec.field(default_factory=time.time)
    publisher: str = ""


json_encode = msgspec.json.encode
json_decode = msgspec.json.decode
pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode
to_builtins = msgspec.to_builtins
