"""Follow the trainer's version events (``rollbus.ckpt.<model>.published``).

Two long-running tasks per engine (:func:`tasks`):

* :func:`track` — always on: an ordered consumer over every event of the served model
  keeps ``engine.latest_published`` (the default of ``update_weights`` when the model
  dir has no ``version.txt``) and a version → stream-sequence index, which also gives
  the serving version's staleness (:func:`staleness_of`, ``ROLLBUS_MAX_STALENESS``).
* :func:`follow` — with ``ROLLBUS_AUTO_UPDATE=true``: a durable pull consumer (one
  durable per instance and model, so a restarted engine resumes where it acked) takes
  every waiting event at once and acts on the newest only: under the engine's control
  lock (operators get 409 meanwhile) it decides whether the event is newer, then pause
  (mode ``auto_update_pause_mode``) → ``update_weights(version,
  auto_update_verify_checksum)`` → resume.

"Newer" is decided by JetStream stream sequence only (:meth:`VersionIndex.is_newer`): a
version's sequence is the one of its *first* announcement, so an event re-announced
after the dedup window (a new sequence carrying an old version string) keeps the old
place; an event applies only if its version differs from the served one and its
sequence is above the highest sequence of any version this engine has served. The
engine never moves back.

Before pausing, the engine looks whether the version's files are there for this
instance (:func:`pending`: the places a rank would look, none of them read in full). If
not — an event ahead of its upload, a snapshot dir still being copied — it does not
pause: it looks again after ``WAIT_S`` doubling up to ``WAIT_MAX_S``, says so once (one
``auto_update`` event, ``action: waiting``, and one warning), and updates once they
are there. Generation is not disturbed meanwhile, and the newest announced version
between the served one and the awaited one whose files are there is served meanwhile
(:func:`_meanwhile`).

An event is acked only once it is applied, ignored as not newer, superseded (any event
but the current target's: un-acked, events ahead of files that never come would pile
up to the durable's max_ack_pending and stall the feed), or failed for good
(400/422: the version itself is bad — recorded as an ``auto_update`` event naming the
``next`` version tried instead; the refused set is part of the engine's stored state,
``services.engine.persist``; a refused version's event again is ignored, no pause).
Any other failure (404: its files or objects are not there yet; 409, 5xx, a rank not
answering) keeps it: it is retried with backoff
(``RETRY_S`` doubling up to ``RETRY_MAX_S``) until it applies or a newer event replaces
it; an engine that dies meanwhile gets it again from its durable. A sleeping engine is
updated too: its ranks validate and record the version, and wakeup loads it. A failed
update resumes on the previous weights (``update_weights`` is all-or-nothing). At a fresh
start it catches up: if a version newer than the served one was published, it updates to
the newest. An engine restarted with its stored state catches up too, but never to a
version at or below the highest one it served (stored: ``high``), so a deliberate
rollback survives it (a state stored without ``high``: its durable only).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from services.engine import control, staleness
from services.engine.state import State
from shared import messages as m
from shared import objstore, presence
from shared.errors import BAD_REQUEST, FORBIDDEN, UNPROCESSABLE, ControlError, PublishDenied
from shared.messages import VersionPublished
from shared.subjects import ckpt_object_name
from shared.versions import check_version_name, ipc_version_dir, model_dir_version

if TYPE_CHECKING:
    from services.engine.main import Engine

log = logging.getLogger("rollbus.autoupdate")

T = TypeVar("T")
ACTOR = "auto_update"
RETRY_S = 1.0
RETRY_MAX_S = 60.0
# the version itself is bad: retrying cannot help (versions are immutable). A 404 is
# kept and retried: the announced version's files may appear later (a snapshot dir
# copied after the event, a replica catching up)
PERMANENT = frozenset({BAD_REQUEST, UNPROCESSABLE})
# an announced version whose files are not there yet (see :func:`pending`) is looked for
# again after WAIT_S, doubling up to WAIT_MAX_S — no pause meanwhile, so the wait costs
# generation nothing, and a look is cheap (a few stats, one NATS round trip): a short
# bound, so a version is taken within WAIT_MAX_S of its files landing
WAIT_S = 0.25
WAIT_MAX_S = 2.0
# while the target's files are not there: how many older announced versions (newer than
# the served one, newest first) are looked at per round for one to serve meanwhile
MEANWHILE_LOOKS = 4
MAX_REFUSED = 256  # refused versions kept in the stored state (the newest ones)


@dataclass
class VersionIndex:
    """Published versions of one model: version → stream sequence of its first publish."""

    seqs: dict[str, int] = field(default_factory=dict)
    latest_seq: int = 0
    latest: str = ""
    served_seq: int = 0  # the highest sequence of any version this engine has served
    high: str = ""  # the version at ``served_seq``
    # ``high`` of the engine's stored state (services.engine.persist): a restored engine
    # never moves back either, as if it had not restarted (its sequence may be learned
    # only after the restore); None: not restored from a state that names it
    stored_high: str | None = None
    changes: int = 0  # bumped whenever ``seqs`` changes (staleness is cached on it)
    # versions this engine can never load (an update failed for good: 400/422, e.g.
    # sharded for another tp): never a target again. They still count toward staleness:
    # the bound counts published versions (strictly on-policy means the trainer's newest)
    refused: set[str] = field(default_factory=set)

    def refuse(self, version: str) -> None:
        if version not in self.refused:
            self.refused.add(version)
            self.changes += 1

    def still_refused(self) -> list[str]:
        """The refused versions that may still be a target (none at or below the served
        sequence ever is), oldest first, at most :data:`MAX_REFUSED`: what the engine's
        stored state keeps (``services.engine.persist``), so a restored engine does not
        try them again. A version whose sequence is not known yet is kept."""
        keep = [v for v in self.refused if not 0 < self.seq_of(v) <= self.served_seq]
        return sorted(keep, key=lambda v: (self.seq_of(v), v))[-MAX_REFUSED:]

    def restore_refused(self, versions: list[str]) -> None:
        """The refused versions of a stored state (an engine restored from it)."""
        for v in versions:
            self.refuse(v)

    def fallback(self, current: str) -> str | None:
        """After the target failed for good: the newest other version newer than the
        served one that is not refused (a fresh start whose newest version is sharded
        for another tp still catches up to the newest it can load), or None."""
        self.served(current)
        best = max(
            (
                (q, v)
                for v, q in self.seqs.items()
                if q > self.served_seq and v != current and v not in self.refused
            ),
            default=None,
        )
        return best[1] if best else None

    def add(self, version: str, seq: int) -> None:
        old = self.seqs.get(version)
        if old is not None and old <= seq:
            return  # a re-announcement keeps the version's first place
        self.seqs[version] = seq
        self.changes += 1
        if old is not None:  # learned out of order: recompute
            self.latest, self.latest_seq = max(self.seqs.items(), key=lambda kv: kv[1])
        elif seq > self.latest_seq:
            self.latest_seq, self.latest = seq, version

    def seq_of(self, version: str) -> int:
        """0 for a version never published (e.g. the model dir's own ``v0``)."""
        return self.seqs.get(version, 0)

    def served(self, version: str) -> None:
        """The engine serves ``version`` (now): nothing at or below its sequence again."""
        for v in (self.stored_high or "", version):
            q = self.seq_of(v)
            if q > self.served_seq:
                self.served_seq, self.high = q, v

    def high_mark(self, current: str) -> str:
        """The version at the highest sequence served (what the stored state keeps)."""
        self.served(current)
        return self.high or self.stored_high or ""

    def is_newer(self, version: str, current: str) -> bool:
        """Whether an event for ``version`` should move an engine serving ``current``."""
        self.served(current)
        return version != current and self.seq_of(version) > self.served_seq


def newest(
    events: list[tuple[int, VersionPublished]], index: VersionIndex | None = None
) -> tuple[int, VersionPublished] | None:
    """The event a burst should end at: the highest (first-publish) sequence."""
    if index is None:
        return max(events, key=lambda e: e[0], default=None)
    return max(events, key=lambda e: (index.seq_of(e[1].version) or e[0], e[0]), default=None)


def index_of(engine: Engine) -> VersionIndex:
    """The engine's version index (kept on the engine: it lives as long as the engine)."""
    idx: VersionIndex | None = getattr(engine, "_version_index", None)
    if idx is None:
        idx = VersionIndex()
        setattr(engine, "_version_index", idx)  # noqa: B010 - Engine does not declare it
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


def staleness_of(engine: Engine) -> tuple[int, str]:
    """``(versions behind, newest announced)`` for the serving version, from the index
    :func:`track` keeps current (auto-update on or off)."""
    idx, serving = index_of(engine), engine.state.weight_version
    return staleness.versions_behind(idx.seqs, serving), idx.latest


_USERINFO = re.compile(r"://[^/@\s]*@")  # a URL's user:password@ (dropped from reasons)


def _why(e: BaseException) -> str:
    """What status may show of a failure: a refusal's code and message (it names the
    subject refused, never the credentials: PublishDenied, ObjectReadDenied), else the
    exception's type and text; any URL's user and password dropped."""
    if isinstance(e, ControlError):
        why = f"{e.code}: {e.message}"
    elif getattr(e, "code", None) == FORBIDDEN:
        why = f"{FORBIDDEN}: {e}"
    else:
        why = f"{type(e).__name__}: {e}"
    return _USERINFO.sub("://", why)


def _failing(engine: Engine, e: BaseException) -> None:
    """The auto-update loop cannot follow its feed: status's ``auto_update_error``
    ({reason, since}: the last failure, since the first of this outage) says so until a
    fetch succeeds. A refused pull or listing backs off quietly (one warning) and
    the engine stays on its version: without it, status showed nothing amiss."""
    prev = getattr(engine, "auto_update_error", None)
    since = prev["since"] if prev else time.time()
    engine.auto_update_error = {"reason": _why(e), "since": since}


async def _until_ok(
    what: str,
    fn: Callable[[], Awaitable[T]],
    on_fail: Callable[[BaseException], None] | None = None,
) -> T:
    """``fn()`` until it succeeds: JetStream may come up after the engine. Each reason
    said once (then at debug), and handed to ``on_fail``. A refusal (403: these
    credentials lack a grant, which an auth.conf reload heals, not time) is tried again
    backing off up to RETRY_MAX_S: it fails at once, so every RETRY_S it was a warning
    and a violation in the server's log a second for ever."""
    refusals, said = 0, ""
    while True:
        try:
            return await fn()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - retried, and said so
            level = logging.WARNING if repr(e) != said else logging.DEBUG
            said = repr(e)
            log.log(level, "%s cannot start yet: %r", what, e)
            if on_fail is not None:
                on_fail(e)
            refused = getattr(e, "code", None) == FORBIDDEN  # PublishDenied, ObjectReadDenied
            refusals = refusals + 1 if refused else 0
            await asyncio.sleep(
                min(RETRY_S * 2 ** min(refusals, 16) / 2, RETRY_MAX_S) if refused else RETRY_S
            )


async def track(engine: Engine) -> None:
    """Keep ``engine.latest_published`` and the version index current, forever."""
    nc = engine.bus.nc
    model = engine.settings.served_model_name

    async def on_event(seq: int, ev: VersionPublished) -> None:
        _learn(engine, seq, ev.version)
        engine.scheduler.work.set()  # what may start under the staleness bound may change

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


async def pending(engine: Engine, version: str, sure: bool = False) -> str | None:
    """Why ``version``'s files are not there yet for this instance, or None: they are
    (or that cannot be told — the update then decides, as before). Looked at where a
    rank would look (its strategy, then the fallbacks, see ``services.worker.sources``):
    with ``ipc`` the ipc dir (``manifest.json``: the SDK renames a complete dir into
    place), the snapshot dir ``versions/V`` (complete for every rank: the rule of
    :mod:`shared.presence`), the object store (the version's ``manifest.json`` object:
    the SDK writes it after every shard). Present in any of them = go. ``sure``: what
    cannot be told counts as not there (a version served meanwhile, :func:`_meanwhile`:
    a wrong guess there costs a pause and a failed update of a version nobody awaits),
    and the reason says which: a look nobody answered ("no answer") or one the server
    refused these credentials ("refused (403)")."""
    s = engine.settings
    model = s.served_model_name
    if version == model_dir_version(s.model_dir):
        return None
    try:
        check_version_name(version)
    except ControlError as e:
        return e.message if sure else None  # the update says why (400)
    why: list[str] = []
    if s.load_strategy == "ipc":
        if (ipc_version_dir(s.ipc_dir, model, version) / presence.MANIFEST).exists():
            return None
        why.append("no ipc dir with a manifest.json")
    d = Path(s.model_dir) / "versions" / version
    if d.is_dir():
        wait = await asyncio.to_thread(presence.snapshot_pending, d, s.tp, range(s.tp))
        if wait is None:
            return None
        why.append(f"versions/{version}: {wait}")
    else:
        why.append(f"no versions/{version}")
    name = ckpt_object_name(model, version, presence.MANIFEST)
    try:
        present = await objstore.object_present(engine.bus.nc, s.ckpt_bucket, name)
    except PublishDenied as e:  # the engine may not look; a rank's credentials may read
        if not sure:
            return None  # the update decides, as for no answer
        why.append(f"{name}: refused ({e.code}): {e.message}")
        return "; ".join(why)
    if present or (present is None and not sure):
        return None
    why.append(f"no {name} in bucket {s.ckpt_bucket}" if present is False else f"{name}: no answer")
    return "; ".join(why)


async def apply(engine: Engine, seq: int, ev: VersionPublished) -> dict[str, Any]:
    """One auto-update cycle for event ``(seq, ev)``; returns what was recorded.

    ``action``: ``updated``, ``ignored`` (not newer), ``failed`` (``retry`` says whether
    it is worth another attempt; a version failed for good is refused here, and
    ``next`` names the version to try instead, or None)."""
    idx = index_of(engine)
    _learn(engine, seq, ev.version)
    s = engine.settings
    async with engine.lock:  # the decision and the update see one state
        current = engine.state.weight_version
        rec: dict[str, Any] = {"version": ev.version, "seq": seq, "previous": current}
        if not idx.is_newer(ev.version, current):
            rec.update(action="ignored", reason=f"not newer than the served version {current!r}")
        elif ev.version in idx.refused:
            # its event again (redelivered after a restart, re-announced, published
            # again): versions are immutable, so no pause for the same 400/422; the
            # next one newer than the served version is tried instead, as at a refusal
            rec.update(
                action="ignored",
                reason="refused here before (400/422)",
                next=idx.fallback(current),
            )
        else:
            asleep = engine.state.state is State.SLEEPING
            if asleep:
                rec["asleep"] = sorted(engine.state.asleep)
            was_paused = engine.state.is_paused
            try:
                if not was_paused:
                    await control.pause(engine, m.PauseArgs(s.auto_update_pause_mode))
                res = await control.update_weights(
                    engine,
                    m.UpdateWeightsArgs(ev.version, s.auto_update_verify_checksum),
                    actor=ACTOR,
                )
                idx.served(ev.version)
                rec.update(action="updated", ok=True, seconds=res["seconds"], bytes=res["bytes"])
            except ControlError as e:
                log.warning("auto-update to %s failed: %s", ev.version, e.message)
                rec.update(
                    action="failed",
                    ok=False,
                    error_code=e.code,
                    error_message=e.message,
                    retry=e.code not in PERMANENT,
                )
                if e.code in PERMANENT:
                    idx.refuse(ev.version)
                    rec["next"] = idx.fallback(current)
            finally:
                if not was_paused:
                    try:
                        await control.resume(engine, m.NoArgs())
                    except ControlError as e:
                        rec.update(resume_error=e.message)
    await engine.event("auto_update", rec)
    return rec


async def _apply_safely(engine: Engine, seq: int, ev: VersionPublished) -> dict[str, Any]:
    try:
        return await apply(engine, seq, ev)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a bus hiccup: kept and retried
        log.warning("auto-update to %s failed: %r", ev.version, e)
        return {"version": ev.version, "seq": seq, "action": "failed", "retry": True}


async def _pending_safely(engine: Engine, version: str) -> str | None:
    """:func:`pending` for a version that would apply (None for any other: the update
    ignores it); None when the look itself fails (the update decides, as before)."""
    idx = index_of(engine)
    if version in idx.refused or not idx.is_newer(version, engine.state.weight_version):
        return None
    try:
        return await pending(engine, version)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - go ahead: the update says what is wrong
        log.debug("auto-update: cannot look for the files of %s: %r", version, e)
        return None


async def _meanwhile(engine: Engine, target: str, skip: set[str], allowed: set[str]) -> str | None:
    """While ``target``'s files are not there: the newest announced version between the
    served one and ``target`` whose files are (one of ``allowed``, not refused, not in
    ``skip``), or None.
    An RL run wants the freshest weights it can have without stalling: before, the
    engine stayed on its old version for as long as the newest one's files were
    missing — for good for an event whose files never come — though a newer one was
    loadable (its event had been settled as superseded)."""
    idx = index_of(engine)
    idx.served(engine.state.weight_version)
    top = idx.seq_of(target)
    older = sorted(
        (
            (q, v)
            for v, q in idx.seqs.items()
            if idx.served_seq < q < top and v in allowed and v not in idx.refused and v not in skip
        ),
        reverse=True,
    )
    for _, v in older[:MEANWHILE_LOOKS]:
        try:
            why = await pending(engine, v, sure=True)
            if why is None:
                return v
            log.debug("auto-update: not serving %s meanwhile: %s", v, why)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - not this one now
            log.debug("auto-update: cannot look for the files of %s: %r", v, e)
    return None


async def _keep(held: list[Any]) -> None:
    """Held events are kept: not redelivered meanwhile, not lost."""
    for msg in held:
        try:
            await msg.in_progress()
        except Exception:  # noqa: BLE001 - redelivered later at worst
            pass


async def _settle(held: list[tuple[str, Any]], keep: str = "") -> list[tuple[str, Any]]:
    """Ack the held events, but those of version ``keep``; returns those."""
    kept = []
    for version, msg in held:
        if version == keep:
            kept.append((version, msg))
            continue
        try:
            await objstore.VersionFeed.ack(msg)
        except Exception:  # noqa: BLE001 - redelivered, then ignored as not newer
            pass
    return kept


async def follow(engine: Engine) -> None:
    """Auto-update loop (see the module doc). Runs until cancelled."""
    nc = engine.bus.nc
    model = engine.settings.served_model_name
    feed = objstore.VersionFeed(nc, model, durable_name(engine.settings.instance, model))
    idx = index_of(engine)
    engine.auto_update_waiting = None  # a restarted loop looks again before saying so
    engine.auto_update_error = None

    async def setup() -> list[tuple[int, VersionPublished]]:
        await objstore.ensure_ckpt_stream(nc, model)
        await feed.start()
        return await objstore.list_versions(nc, model)

    past = await _until_ok("auto-update", setup, lambda e: _failing(engine, e))
    engine.auto_update_error = None
    for seq, ev in past:
        _learn(engine, seq, ev.version)
    # the pending target (catch-up first) and the events it answers, acked once settled.
    # An engine that restored a state naming the highest version it served (``high``)
    # catches up like a fresh one: no version at or below it is ever newer
    # (:meth:`VersionIndex.served`), so an operator's rollback is not undone, and the
    # wait it was in when it died goes on at once (that event, held un-acked, would
    # come back from the durable only after its ack wait, 10 min). One restored from an
    # older record catches up through its durable only (what was published while it
    # was down is not acked yet): the newest version may be one an operator rolled
    # back from, which a catch-up would undo
    restored = getattr(engine, "restored", False) and idx.stored_high is None
    target = None if restored else newest(past, idx)
    # what may be served while the target's files are awaited: a fresh start catches up,
    # so any announced version; a restored engine without ``high`` only what its durable
    # delivers (not a version an operator rolled back from, acked long ago)
    meanwhile_ok: set[str] = set() if restored else {ev.version for _, ev in past}
    if target and not idx.is_newer(target[1].version, engine.state.weight_version):
        target = None
    held: list[tuple[str, Any]] = []  # (version, message) of every event not settled
    backoff, next_try = RETRY_S, 0.0
    wait_s, waiting = WAIT_S, ""  # the version whose files are awaited (said once)
    since = 0.0  # when that wait began
    tried_for, tried = "", set[str]()  # versions tried meanwhile, for that target
    feed_errors = 0
    loop = asyncio.get_running_loop()
    while True:
        wait = min(1.0, max(0.05, next_try - loop.time())) if target else 1.0
        try:
            batch = await feed.fetch(timeout=wait)
            feed_errors = 0
            engine.auto_update_error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reconnecting, or the durable is gone
            feed_errors += 1
            _failing(engine, e)
            # said once per outage (a reconnect is noise); the durable is re-created: a
            # deleted one (`nats consumer rm`, JetStream state lost) otherwise fails every
            # fetch for ever and auto-update stops without a word
            log.log(
                logging.WARNING if feed_errors == 1 else logging.DEBUG,
                "version feed: %r; subscribing again",
                e,
            )
            # a refused pull is not healed by a reconnect (an auth.conf reload heals it):
            # its tries back off up to RETRY_MAX_S, not a refused fetch, a consumer
            # re-created and a violation in nats-server's log every RETRY_S for ever
            pause = RETRY_S
            if isinstance(e, PublishDenied):
                pause = min(RETRY_S * 2 ** min(feed_errors - 1, 16), RETRY_MAX_S)
            await asyncio.sleep(pause)
            try:
                await feed.restart()
            except asyncio.CancelledError:
                raise
            except Exception as e2:  # noqa: BLE001 - next round
                log.debug("version feed: cannot subscribe again yet: %r", e2)
            continue  # `held` stays: acks go to the durable, not to the subscription
        for seq, ev, msg in batch:
            _learn(engine, seq, ev.version)
            held.append((ev.version, msg))
            meanwhile_ok.add(ev.version)
        top = newest([(seq, ev) for seq, ev, _ in batch], idx)
        if top and (target is None or idx.seq_of(top[1].version) > idx.seq_of(target[1].version)):
            target, backoff, next_try = top, RETRY_S, 0.0  # a newer one replaces a retry
        if target is not None and batch:
            # every event but the target's is settled (superseded, or older): acked now,
            # not when the target applies — un-acked, events ahead of their files (never
            # coming) pile up to the durable's max_ack_pending (1000), past which
            # JetStream delivers no newer event: auto-update would wait for an old
            # version for ever
            held = await _settle(held, keep=target[1].version)
        if target is None or loop.time() < next_try:
            continue
        version = target[1].version
        why = await _pending_safely(engine, version)
        if why is not None:  # not even paused: generation goes on undisturbed
            if waiting != version:
                waiting, wait_s = version, WAIT_S
                log.warning("auto-update: waiting for the files of %s: %s", version, why)
                rec: dict[str, Any] = {
                    "version": version,
                    "seq": target[0],
                    "action": "waiting",
                    "reason": why,
                }
                await engine.event("auto_update", rec)
                since = time.time()
            engine.auto_update_waiting = {"version": version, "reason": why, "since": since}
            next_try = loop.time() + wait_s
            wait_s = min(wait_s * 2, WAIT_MAX_S)
            await _keep([msg for _, msg in held])
            if tried_for != version:
                tried_for, tried = version, set()
            alt = await _meanwhile(engine, version, tried, meanwhile_ok)
            if alt is not None:  # served meanwhile; the target is still waited for
                log.info("auto-update: serving %s while waiting for %s", alt, version)
                ev = VersionPublished(target[1].model, alt, target[1].tp)
                done = await _apply_safely(engine, idx.seq_of(alt), ev)
                if done["action"] == "failed":
                    tried.add(alt)  # once per target: no retry loop beside the wait
                    if not done.get("retry"):
                        await engine.persist.save()  # refused: stored
            continue
        engine.auto_update_waiting = None
        if waiting == version:
            log.info("auto-update: the files of %s are there", version)
        rec = await _apply_safely(engine, *target)
        if rec["action"] == "failed" and not rec.get("retry"):
            await engine.persist.save()  # a restored engine does not try it again
        if rec["action"] != "updated":  # refused now or before: maybe another to try
            nxt = rec.get("next")
            if nxt is not None:  # the events so far are settled; go on to the next newest
                log.warning(
                    "auto-update: %s cannot be loaded here; trying %s", target[1].version, nxt
                )
                held = await _settle(held)
                target = (idx.seq_of(nxt), VersionPublished(target[1].model, nxt, target[1].tp))
                backoff, next_try = RETRY_S, 0.0
                continue
        if rec["action"] == "failed" and rec.get("retry"):
            next_try = loop.time() + backoff
            backoff = min(backoff * 2, RETRY_MAX_S)
            await _keep([msg for _, msg in held])
            continue
        held, target = await _settle(held), None
