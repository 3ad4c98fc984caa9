"""The staleness bound (AReaL's ``max_head_offpolicyness``). Pure.

``ROLLBUS_MAX_STALENESS=k``: while the serving version is more than ``k`` published
versions behind the newest version announced for the model, *new* requests wait in the
queue (they are not scheduled); requests already started go on. ``0`` = strictly
on-policy. A request may carry its own ``max_staleness``; the stricter of the two
applies (a request can tighten the bound, never loosen it).

"Versions behind" counts the distinct versions announced on
``rollbus.ckpt.<model>.published`` whose first announcement (stream sequence) comes
after the serving version's. A serving version never announced there (the model dir's
own ``version.txt``, a local snapshot) counts as older than every announced version: it
is behind by all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


def versions_behind(seqs: Mapping[str, int], serving: str) -> int:
    """How many announced versions (``version -> sequence of its first announcement``)
    came after ``serving``."""
    mine = seqs.get(serving, 0)
    return sum(1 for v, seq in seqs.items() if seq > mine and v != serving)


def bound(setting: int | None, request: int | None) -> int | None:
    """The bound that applies to one request: the stricter of both; None = no bound."""
    if setting is None:
        return request
    if request is None:
        return setting
    return min(setting, request)


def holds(behind: int, setting: int | None, request: int | None) -> bool:
    """Whether a request that has not started yet must wait at ``behind`` versions."""
    b = bound(setting, request)
    return b is not None and behind > b


@dataclass
class Staleness:
    """What ``/v1/status`` shows as ``staleness`` (and ``/metrics`` as gauges)."""

    behind: int  # versions the serving version is behind the newest announced
    max_staleness: int | None  # ROLLBUS_MAX_STALENESS (None = no bound)
    newest: str  # newest version announced for the model ("" = none yet)
    serving: str
    waiting: int  # requests not started because of a bound (the setting's or their own)

    @property
    def stale(self) -> bool:
        return self.max_staleness is not None and self.behind > self.max_staleness

    def to_dict(self) -> dict[str, object]:
        return {
            "behind": self.behind,
            "max_staleness": self.max_staleness,
            "stale": self.stale,
            "newest": self.newest,
            "serving": self.serving,
            "waiting": self.waiting,
        }
