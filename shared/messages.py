"""Every message on the bus, as msgspec Structs, with their encoders. Pure: no I/O.

Control and event messages are JSON so the ``nats`` CLI can speak them; the hot path
(step commands, token chunks) is msgpack through the same Structs.
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

import msgspec

from shared.errors import BAD_REQUEST, ControlError

T = TypeVar("T")
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
    mode: PauseMode = "abort"


class TagArgs(msgspec.Struct, forbid_unknown_fields=True):
    """``sleep`` / ``wakeup`` arguments; tags as a list or a comma-separated string."""

    tags: list[str] | str | None = None

    def tag_set(self) -> tuple[str, ...]:
        return parse_tags(self.tags)


class UpdateWeightsArgs(msgspec.Struct, forbid_unknown_fields=True):
    version: str | None = None
    verify_checksum: bool | None = None  # None: verify wherever a manifest exists


class NoArgs(msgspec.Struct):
    pass


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
            BAD_REQUEST, f"unknown tag(s) {unknown}: allowed tags are {list(SLEEP_TAGS)}"
        )
    return tuple(t for t in SLEEP_TAGS if t in items)


def decode_args(data: bytes, kind: type[T]) -> T:
    """Decode control arguments strictly; a wrong type or field is a 400 naming it."""
    if not data.strip():
        data = b"{}"
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise ControlError(BAD_REQUEST, f"bad argument: {e}") from None
    except msgspec.DecodeError as e:
        raise ControlError(BAD_REQUEST, f"body is not valid JSON: {e}") from None


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


class SleepWorkerArgs(msgspec.Struct):
    tags: list[str]
    shutdown_comm_group: bool = False


class WakeupWorkerArgs(msgspec.Struct):
    tags: list[str]
    version: str
    strategy: str = "snapshot"


# --------------------------------------------------------------------------- generation
# msgpack on the wire (hot path); array_like keeps step messages small.


class SamplingSpec(msgspec.Struct, array_like=True):
    """How rank 0 samples one sequence's next token."""

    seq_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    salt: int = 0  # the choice index: seeded choices of one request differ, yet reproduce
    logprobs: bool = False


class GenRequest(msgspec.Struct):
    """API -> engine on ``rollbus.<i>.gen``; chunks stream back to the reply inbox."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False
    stop_token_ids: list[int] = msgspec.field(default_factory=list)


class VersionSpan(msgspec.Struct, array_like=True):
    """Output tokens ``[start, end)`` of a choice were generated with ``version``."""

    version: str
    start: int
    end: int


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
    heartbeat: bool = False


class GenCancel(msgspec.Struct):
    request_id: str


class StepRow(msgspec.Struct, array_like=True):
    """One sequence's part of a step: new tokens from ``start_pos``, its block table, and
    the sequences to sample from its last position (empty for a mid-prefill chunk)."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: list[SamplingSpec]


class StepRequest(msgspec.Struct, array_like=True):
    step: int
    rows: list[StepRow]
    copies: list[tuple[int, int]] = msgspec.field(default_factory=list)  # KV block src->dst
    finished: list[int] = msgspec.field(default_factory=list)  # seq ids rank 0 may forget


class StepReply(msgspec.Struct, array_like=True):
    """Rank 0's answer: one (seq_id, token, logprob) per sampling spec, in order."""

    step: int
    seq_ids: list[int]
    tokens: list[int]
    logprobs: list[float]
    error: str = ""
    seconds: float = 0.0


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
