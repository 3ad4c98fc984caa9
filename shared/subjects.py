"""Subject names of the bus contract, and reversible escaping of one subject token.

Pure functions only. A model id or instance name becomes exactly one NATS token: the
characters NATS gives meaning to (``.``, ``*``, ``>``), whitespace and our escape
character ``~`` are written as ``~XX`` (hex of the UTF-8 byte), so ``Qwen2.5-0.5B``
becomes ``Qwen2~2E5-0~2E5B`` and ``unescape_token`` gives the id back.
"""

from __future__ import annotations

import re

_SPECIAL = re.compile(r"[.*>~\s]")
_HEX2 = re.compile(r"[0-9A-F]{2}")

ROOT = "rollbus"
EVENTS_STREAM = "ROLLBUS_EVENTS"
CKPT_STREAM = "ROLLBUS_CKPT"


def escape_token(name: str) -> str:
    """One NATS subject token for ``name``; reversible with :func:`unescape_token`."""
    if not name:
        raise ValueError("a subject token cannot be empty")
    return _SPECIAL.sub(lambda m: "".join(f"~{b:02X}" for b in m.group().encode()), name)


def unescape_token(token: str) -> str:
    """Inverse of :func:`escape_token` (every ``~`` in an escaped token starts an escape)."""
    out = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "~" and _HEX2.fullmatch(token[i + 1 : i + 3]):
            out.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            out += token[i].encode()
            i += 1
    return out.decode()


class Subjects:
    """All subjects of one instance (``rollbus.<instance>.…``)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.prefix = f"{ROOT}.{escape_token(instance)}"

    def ctl(self, method: str) -> str:
        return f"{self.prefix}.ctl.{method}"

    def worker_ctl(self, method: str) -> str:
        return f"{self.prefix}.worker.ctl.{method}"

    @property
    def worker_step(self) -> str:
        return f"{self.prefix}.worker.step"

    @property
    def gen(self) -> str:
        return f"{self.prefix}.gen"

    @property
    def weights_get(self) -> str:
        """Read-only: every rank opens a read of its served weights (trainer, operator)."""
        return f"{self.prefix}.weights.get"

    def weights_rank(self, rank: int) -> str:
        """Read-only: chunks of rank ``rank``'s open weight read."""
        return f"{self.prefix}.weights.{rank}"

    def event(self, kind: str) -> str:
        return f"{self.prefix}.events.{kind}"


def ckpt_published(model: str) -> str:
    return f"{ROOT}.ckpt.{escape_token(model)}.published"


CKPT_WILDCARD = f"{ROOT}.ckpt.*.published"


def ckpt_object_name(model: str, version: str, file: str) -> str:
    """Object-store name ``<model>/<version>/<file>`` (object names may hold any char)."""
    return f"{model}/{version}/{file}"


def rank_shard_file(rank: int, tp: int) -> str:
    return f"rank{rank}-of-{tp}.safetensors"
