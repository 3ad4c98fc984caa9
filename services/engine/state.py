"""The engine's state machine, as pure transitions (no I/O, unit-tested alone).

::

    running --pause--> paused --update_weights--> updating --(done/failed)--> paused
       ^                 |  \\--resume--> running
       |               sleep
       |                 v
       +----wakeup--- sleeping --update_weights--> updating --> sleeping
                      (sleep from running pauses first)

``is_paused`` is true in every state but ``running``: nothing is scheduled then. An
update while sleeping returns to sleeping (the ranks record the new version; wakeup
loads it).
Each check raises ``ControlError`` with the contract's status code (409 wrong state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from shared.errors import BAD_REQUEST, CONFLICT, ControlError


class State(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    SLEEPING = "sleeping"
    UPDATING = "updating"


@dataclass
class EngineState:
    state: State = State.RUNNING
    asleep: set[str] = field(default_factory=set)  # tags freed on the ranks
    weight_version: str = ""
    pause_mode: str = ""
    updating_from: State = State.PAUSED  # where an update returns to

    @property
    def is_paused(self) -> bool:
        return self.state is not State.RUNNING

    def pause(self, mode: str) -> bool:
        """Returns whether the state changed (pause is idempotent)."""
        if self.state is State.UPDATING:
            raise ControlError(CONFLICT, "cannot pause: update_weights is in progress")
        if self.state is State.RUNNING:
            self.state = State.PAUSED
            self.pause_mode = mode
            return True
        return False

    def resume(self) -> bool:
        if self.state is State.SLEEPING:
            raise ControlError(
                CONFLICT, f"cannot resume while sleeping ({sorted(self.asleep)} freed): call wakeup"
            )
        if self.state is State.UPDATING:
            raise ControlError(CONFLICT, "cannot resume: update_weights is in progress")
        if self.state is State.PAUSED:
            self.state = State.RUNNING
            self.pause_mode = ""
            return True
        return False

    def begin_update(self) -> None:
        self.check_update()
        self.updating_from = self.state
        self.state = State.UPDATING

    def check_update(self) -> None:
        """Raise the 409 ``begin_update`` would, without changing anything."""
        if self.state is State.RUNNING:
            raise ControlError(
                CONFLICT, "update_weights requires a paused engine: call pause first"
            )
        if self.state is State.UPDATING:
            raise ControlError(CONFLICT, "another update_weights is in progress")

    def end_update(self, version: str | None) -> None:
        """Back to paused (or sleeping); ``version`` is the committed one, ``None`` after
        a failure."""
        if version is not None:
            self.weight_version = version
        self.state = self.updating_from

    def sleep(self, tags: tuple[str, ...]) -> None:
        if self.state is State.UPDATING:
            raise ControlError(CONFLICT, "cannot sleep: update_weights is in progress")
        self.state = State.SLEEPING
        self.asleep |= set(tags)

    def check_wakeup(self, tags: tuple[str, ...], use_cudagraph: bool) -> None:
        kv_still_asleep = "kv_cache" in self.asleep or self.state is not State.SLEEPING
        if use_cudagraph and "weight" in tags and "kv_cache" not in tags and kv_still_asleep:
            raise ControlError(
                BAD_REQUEST,
                "with USE_CUDAGRAPH the KV cache must wake up with (or before) the weights: "
                "use tags=weight,kv_cache",
            )
        if self.state is State.UPDATING:
            raise ControlError(CONFLICT, "cannot wake up: update_weights is in progress")

    def woke(self, tags: tuple[str, ...]) -> bool:
        """Record restored tags; returns True when fully awake (and so resumed)."""
        self.asleep -= set(tags)
        if self.asleep:
            return False
        self.state = State.RUNNING
        self.pause_mode = ""
        return True
