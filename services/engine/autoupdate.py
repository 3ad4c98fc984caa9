"""Follow the trainer's version events (``rollbus.ckpt.<model>.published``).

Two long-running tasks per engine (:func:`tasks`):

* :func:`track` — always on: an ordered consumer over every event of the served model
  keeps ``engine.latest_published`` (the default of ``update_weights`` when the model
  dir has no ``version.txt``) and a version → stream-sequence index. The sequence is a
  version's place in publish order: "older" means a smaller sequence.
* :func:`follow` — with ``ROLLBUS_AUTO_UPDATE=true``: a durable pull consumer (one
  durable per instance and model, so a restarted engine resumes where it acked) takes
  every waiting event at once and acts on the newest only: pause (mode
  ``auto_update_pause_mode``) → ``update_weights(version, auto_update_verify_checksum)``
  → resume, all under the engine's control lock (operators get 409 meanwhile). An event
  whose sequence is not above the served version's is acked and ignored, so a burst
  ends at the newest version and never goes back. A failed update resumes on the
  previous weights (``update_weights`` is all-or-nothing) and is recorded as an
  ``auto_update`` event. At start it catches up: if a version newer than the served one
  was published while the engine was down, it updates to the newest.

Events are acked after they are acted on: an engine that dies mid-update gets them
again from its durable when it comes back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from services.engine import control
from services.engine.state import State
from shared import messages as m
from shared import objstore
from shared.errors import ControlError
from shared.messages import VersionPublished

if TYPE_CHECKING:
    from services.engine.main import Engine

log = logging.getLogger("rollbus.autoupdate")

T = TypeVar("T")
ACTOR = "auto_update"
RETRY_S = 1.0


@dataclass
class VersionIndex:
    """Published versions of one model: version → stream sequence (first publish)."""

    seqs: dict[str, int] = field(default_factory=dict)
    latest_seq: int = 0
    latest: str = ""

    def add(self, version: str, seq: int) -> None:
        self.seqs.setdefault(version, seq)
        if seq > self.latest_seq:
            self.latest_seq, self.latest = seq, version

    def seq_of(self, version: str) -> int:
        """0 for a version never published (e.g. the model dir's own ``v0``)."""
        return self.seqs.get(version, 0)

    def is_newer(self, seq: int, current: str) -> bool:
        return seq > self.seq_of(current)


def newest(events: list[tuple[int, VersionPublished]]) -> tuple[int, VersionPublished] | None:
    """The event with the highest sequence (the one a burst should end at)."""
    return max(events, key=lambda e: e[0], default=None)


_indexes: weakref.WeakKeyDictionary[Any, VersionIndex] = weakref.WeakKeyDictionary()


def index_of(engine: Engine) -> VersionIndex:
    idx = _indexes.get(engine)
    if idx is None:
        idx = _indexes[engine] = VersionIndex()
    return idx


def durable_name(instance: str, model: str) -> str:
    """A JetStream durable name for (instance, model): safe characters plus a hash, so
    two ids that sanitize alike still get different durables."""
    raw = f"{instance}\0{model}"
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", f"{instance}_{model}")[:48]
    return f"rollbus_au_{safe}_{hashlib.sha256(raw.encode()).hexdigest()[:8]}"


def _learn(engine: Engine, seq: int, version: str) -> None:
    idx = index_of(engine)
    idx.add(version, seq)
    engine.latest_published = idx.latest


async def _until_ok(what: str, fn: Callable[[], Awaitable[T]]) -> T:
    """``fn()`` until it succeeds: JetStream may come up after the engine."""
    while True:
        try:
            return await fn()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - retried, and said so
            log.warning("%s cannot start yet: %r", what, e)
            await asyncio.sleep(RETRY_S)


async def track(engine: Engine) -> None:
    """Keep ``engine.latest_published`` and the version index current, forever."""
    nc = engine.bus.nc
    model = engine.settings.served_model_name

    async def on_event(seq: int, ev: VersionPublished) -> None:
        _learn(engine, seq, ev.version)

    async def setup() -> Any:
        await objstore.ensure_ckpt_stream(nc, model)
        return await objstore.watch_versions(nc, model, on_event)

    sub = await _until_ok("version tracking", setup)
    try:
        await asyncio.Event().wait()
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - shutting down
            pass


async def apply(engine: Engine, seq: int, ev: VersionPublished) -> dict[str, Any]:
    """One auto-update cycle for event ``(seq, ev)``; returns what was recorded."""
    idx = index_of(engine)
    _learn(engine, seq, ev.version)
    current = engine.state.weight_version
    rec: dict[str, Any] = {"version": ev.version, "seq": seq, "previous": current}
    if ev.version == current or not idx.is_newer(seq, current):
        rec.update(action="ignored", reason=f"not newer than the served version {current!r}")
        await engine.event("auto_update", rec)
        return rec
    s = engine.settings
    async with engine.lock:
        if engine.state.state is State.SLEEPING:
            rec.update(action="skipped", reason="engine is asleep")
            await engine.event("auto_update", rec)
            return rec
        was_paused = engine.state.is_paused
        try:
            if not was_paused:
                await control.pause(engine, m.PauseArgs(s.auto_update_pause_mode))
            res = await control.update_weights(
                engine,
                m.UpdateWeightsArgs(ev.version, s.auto_update_verify_checksum),
                actor=ACTOR,
            )
            rec.update(action="updated", ok=True, seconds=res["seconds"], bytes=res["bytes"])
        except ControlError as e:
            log.warning("auto-update to %s failed: %s", ev.version, e.message)
            rec.update(action="failed", ok=False, error_code=e.code, error_message=e.message)
        finally:
            if not was_paused:
                try:
                    await control.resume(engine, m.NoArgs())
                except ControlError as e:
                    rec.update(resume_error=e.message)
    await engine.event("auto_update", rec)
    return rec


async def follow(engine: Engine) -> None:
    """Auto-update loop (see the module doc). Runs until cancelled."""
    nc = engine.bus.nc
    model = engine.settings.served_model_name
    feed = objstore.VersionFeed(nc, model, durable_name(engine.settings.instance, model))

    async def setup() -> list[tuple[int, VersionPublished]]:
        await objstore.ensure_ckpt_stream(nc, model)
        await feed.start()
        return await objstore.list_versions(nc, model)

    past = await _until_ok("auto-update", setup)
    for seq, ev in past:
        _learn(engine, seq, ev.version)
    catch_up = newest(past)
    if catch_up and index_of(engine).is_newer(catch_up[0], engine.state.weight_version):
        await apply(engine, *catch_up)
    while True:
        try:
            batch = await feed.fetch(timeout=1.0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reconnecting: try again
            log.debug("version feed: %r", e)
            await asyncio.sleep(RETRY_S)
            continue
        if not batch:
            continue
        for seq, ev, _ in batch:
            _learn(engine, seq, ev.version)
        top = newest([(seq, ev) for seq, ev, _ in batch])
        assert top is not None
        await apply(engine, *top)
        for _, _, msg in batch:
            await objstore.VersionFeed.ack(msg)


def tasks(engine: Engine) -> list[asyncio.Task[None]]:
    """The tasks to run for the engine's lifetime: ``tasks += autoupdate.tasks(engine)``."""
    out = [asyncio.create_task(track(engine), name="versions-track")]
    if engine.settings.auto_update:
        out.append(asyncio.create_task(follow(engine), name="versions-follow"))
    return out
