"""The engine's state, kept in the JetStream KV bucket ``rollbus_state`` (one key per
instance, see ``shared.statekv``), and what a restarted engine or restarted ranks do
with it.

* :class:`Record` — state (running / paused / sleeping / updating), the freed tags, the
  serving version, the pause mode, the versions auto-update refused for good, the
  highest version ever served (a restored engine never moves back) and, while
  ``update_weights`` runs, the update in progress (id, version, previous version).
  Saved on every state change and after every mutating control call
  (:meth:`Persister.save`); a write that fails (NATS down) is retried every second
  until it lands.
* :func:`restore` — at engine start: the record, if any, becomes the engine's state. An
  update that was in progress is resolved: the engine comes back paused on the
  *previous* version and :func:`reconcile` rolls every rank back to it.
* :func:`reconcile` — brings every rank to the engine's version and sleep state: rolls
  back an interrupted update by id, wakes ranks that are asleep while the engine is
  awake, stages + commits the engine's version on all ranks if any rank serves another
  one (restarted ranks load the model dir's version), then frees what the engine has
  asleep. Runs at start and whenever the ranks come back with new pids (the launcher
  restarted them) or a rank's version differs from the engine's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from services.engine import autoupdate, control
from services.engine.ranks import RankError
from services.engine.state import State
from shared import messages as m
from shared.bus import new_request_id
from shared.errors import ControlError
from shared.statekv import StateBucket

if TYPE_CHECKING:
    from services.engine.main import Engine

log = logging.getLogger("rollbus.engine.persist")

RETRY_S = 1.0
COALESCE_S = 0.0  # background writes yield once: changes made meanwhile are one write
TAGS = ("weight", "kv_cache")
# how long reconcile waits for a rank's ``drain`` (and the status and ping answered on
# its event loop): a rank whose compute thread is free answers in milliseconds (behind
# at most the steps already sent it); a silent rank, or one whose compute thread is
# stuck (e.g. in a comm group barrier its peer never joins), must not hold the control
# lock — or a fleet update's finish, and with it generation — for CONTROL_TIMEOUT_S.
# A drain that gives up leaves the ranks unsettled: reconcile is tried again later.
DRAIN_S = 2.0
# ... and at least this many of the engine's recent steps (its moving average): a drain
# queues behind the steps already sent (two while pipelined, plus the one computing), so
# on a slow model or a loaded host a fixed 2 s would time out every try while
# generation runs, and the re-assert would never happen
DRAIN_STEPS = 4


def drain_bound(eng: Engine) -> float:
    step = float(getattr(eng.scheduler, "step_avg", 0.0) or 0.0)
    return min(max(DRAIN_S, DRAIN_STEPS * step), eng.settings.control_timeout_s)


class Update(msgspec.Struct):
    update_id: str
    version: str
    previous: str
    fleet_txn: str = ""  # a fleet transaction's update (services.engine.fleet)
    resume: bool = False  # the fleet transaction paused a running engine: resume after


class Record(msgspec.Struct):
    state: str
    weight_version: str
    asleep: list[str] = msgspec.field(default_factory=list)
    pause_mode: str = ""
    update: Update | None = None
    saved_at: float = 0.0
    # versions auto-update refused for good here (400/422): a restored engine does not
    # try them again (services.engine.autoupdate; they still count toward staleness)
    refused: list[str] = msgspec.field(default_factory=list)
    # the version with the highest stream sequence this engine ever served: a restored
    # engine never moves back to one at or below it either — so it catches up (and goes
    # on with a wait for files) like a fresh start without undoing an operator's
    # rollback ("": none published yet). None (a record of an older engine): it follows
    # its durable only
    high: str | None = None


def encode(rec: Record) -> bytes:
    return msgspec.json.encode(rec)


# without these a record says nothing: one that is not there (or not readable) is refused
# whole. Every other field has a default: a bad one is dropped alone (below).
REQUIRED = ("state", "weight_version")


def decode(data: bytes) -> Record:
    """Raises ``ValueError`` naming the problem for a record this version cannot read.

    A field other than :data:`REQUIRED` that does not read (a corrupt or hand-edited
    ``refused``, ``asleep``, ``update``…) is dropped alone, with one warning naming it:
    before, one such field made the whole record unreadable, and the engine started
    from the ranks' state — losing its version, pause state and interrupted update."""
    try:
        raw = msgspec.json.decode(data)
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON object is needed, not {type(raw).__name__}")
        try:
            rec = msgspec.convert(raw, type=Record)
        except msgspec.ValidationError:
            # the required fields alone first: a record refused whole says only why, not
            # that each good optional field was "ignored" for the missing one's reason
            msgspec.convert({k: raw[k] for k in REQUIRED if k in raw}, type=Record)
            rec = _salvage(raw)
        State(rec.state)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"unreadable engine state record: {e}") from None
    return rec


def _salvage(raw: dict[str, Any]) -> Record:
    """The record without the optional fields that do not read (each said once)."""
    keep = {k: raw[k] for k in REQUIRED if k in raw}
    for name in Record.__struct_fields__:
        if name in REQUIRED or name not in raw:
            continue
        try:  # this field alone, beside the required ones
            msgspec.convert({**keep, name: raw[name]}, type=Record)
        except msgspec.ValidationError as e:
            log.warning("engine state record: field %r ignored (%s)", name, e)
            continue
        keep[name] = raw[name]
    return msgspec.convert(keep, type=Record)


def snapshot(eng: Engine, update: Update | None = None) -> Record:
    st = eng.state
    return Record(
        state=st.state.value,
        weight_version=st.weight_version,
        asleep=sorted(st.asleep),
        pause_mode=st.pause_mode,
        update=update if st.state is State.UPDATING else None,
        saved_at=time.time(),
        refused=autoupdate.index_of(eng).still_refused(),
        high=autoupdate.index_of(eng).high_mark(st.weight_version),
    )


def apply(eng: Engine, rec: Record) -> Update | None:
    """Make ``rec`` the engine's state; returns the interrupted update, if any.

    An interrupted update leaves the engine paused on the previous version (the record's
    ``weight_version``: it only moves when a commit succeeded everywhere)."""
    st = eng.state
    st.weight_version = rec.weight_version
    st.asleep = set(rec.asleep) & set(TAGS)
    st.pause_mode = rec.pause_mode
    state = State(rec.state)
    if state is State.UPDATING:
        state = State.SLEEPING if st.asleep else State.PAUSED
        st.pause_mode = st.pause_mode or "abort"
    st.state = state
    autoupdate.index_of(eng).restore_refused(rec.refused)
    autoupdate.index_of(eng).stored_high = rec.high
    if state is not State.RUNNING:  # at start: nothing scheduled yet, no step in flight
        eng.scheduler.admit = eng.scheduler.run = False
    return rec.update


class Persister:
    """Writes the engine's record, one write at a time, skipping unchanged records.

    A change of version or of the update in progress is written before :meth:`save`
    returns (a restart must know what to roll back). Other changes (pause, resume,
    sleep, wakeup) are handed to the background writer (:meth:`run`), so the control
    path does not wait for a JetStream ack (the write follows the reply within about a
    millisecond; changes made meanwhile are one write, none if they end where they
    began). A failed write is retried every second.
    """

    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.bucket = StateBucket(eng.bus.nc, eng.settings.instance)
        self.update: Update | None = None  # the update in progress, while updating
        self._written: Record | None = None
        self._pending: Record | None = None
        self._kick = asyncio.Event()
        self._io = asyncio.Lock()
        self._failing = False
        self.writes = 0
        self.failures = 0

    def state_changed(self, to: str, data: dict[str, Any]) -> None:
        """Learn the update in progress from the ``updating`` state event."""
        if to == State.UPDATING.value:
            uid, ver, prev = (str(data.get(k, "")) for k in ("update_id", "version", "from"))
            fleet = str(data.get("fleet_txn", ""))
            self.update = Update(uid, ver, prev, fleet, bool(data.get("resume", False)))
        elif self.eng.state.state is not State.UPDATING:
            self.update = None

    async def save(self) -> None:
        rec = snapshot(self.eng, self.update)
        last = self._written
        if last is not None and _same(rec, last) and self._pending is None:
            return
        # written at once: what a restart must know (what to roll back, what not to try)
        if last is None or (rec.update, rec.weight_version, rec.refused) != (
            last.update,
            last.weight_version,
            last.refused,
        ):
            self._pending = None  # this one is newer
            await self._write(rec)
        else:
            self._pending = rec
            self._kick.set()

    async def _write(self, rec: Record) -> bool:
        async with self._io:
            try:
                await self.bucket.put(encode(rec))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - retried by run(), never fails a call
                self.failures += 1
                self._pending = self._pending or rec
                if not self._failing:
                    log.warning("could not save the engine state (retrying): %r", e)
                self._failing = True
                return False
            if self._failing:
                log.warning("engine state saved again")
            self._failing = False
            self._written = rec
            self.writes += 1
            return True

    async def load(self) -> Record | None:
        """The stored record; waits for the bucket while NATS is not there yet."""
        while True:
            try:
                data = await self.bucket.get()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - JetStream may come up after us
                log.warning("cannot read the engine state yet: %r", e)
                await asyncio.sleep(RETRY_S)
        if data is None:
            return None
        try:
            return decode(data)
        except ValueError as e:
            log.error("%s; starting from the ranks' state", e)
            return None

    async def run(self) -> None:
        """The background writer: the newest pending record, retried until it lands."""
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), RETRY_S)
            except TimeoutError:
                pass
            self._kick.clear()
            await asyncio.sleep(COALESCE_S)
            rec, self._pending = self._pending, None
            if rec is not None and self._written is not None and _same(rec, self._written):
                continue
            if rec is not None and not await self._write(rec):
                await asyncio.sleep(RETRY_S)


def _same(a: Record, b: Record) -> bool:
    return (a.state, a.weight_version, a.asleep, a.pause_mode, a.update, a.refused, a.high) == (
        b.state,
        b.weight_version,
        b.asleep,
        b.pause_mode,
        b.update,
        b.refused,
        b.high,
    )


async def reconcile(eng: Engine, update: Update | None = None) -> dict[str, Any]:
    """Bring every rank to the engine's version and sleep state (caller holds the
    control lock). Raises ``ControlError`` naming the rank and step that failed."""
    st, s = eng.state, eng.settings
    target = st.weight_version
    done: dict[str, Any] = {"version": target}
    if update is not None and update.update_id:
        reps = await eng.ranks.call("rollback", m.UpdateIdArgs(update.update_id))
        done["rolled_back"] = sorted(r for r, rep in reps.items() if rep.result.get("rolled_back"))
    # every call a rank still holds (late ones a stopped rank got before it stopped) has
    # run before its state is looked at: nothing it does afterwards undoes what follows
    quick = drain_bound(eng)
    try:
        await eng.ranks.call("drain", timeout=quick)
    except RankError as e:
        # what a rank holds may still run (it changes that rank): once every rank
        # answers again, the watcher brings them back to the engine's state
        eng.ranks.unsettled = f"reconcile: {e.message}"
        eng.ranks.unsettled_n += 1
        raise
    ranks = await eng.ranks.statuses(timeout=quick)
    dead = [r["rank"] for r in ranks if not r.get("alive")]
    if dead:
        raise RankError(503, f"reconcile: ranks {dead} did not answer", {})
    versions = {int(r["rank"]): str(r["version"]) for r in ranks}
    mismatch = any(v != target for v in versions.values()) and bool(target)
    unloaded = any(not r["weights_loaded"] for r in ranks)
    awake = ("weights_loaded", "kv_allocated", "comm_group")
    not_awake = any(not all(r[k] for k in awake) for r in ranks)
    if (mismatch and unloaded) or (not st.asleep and not_awake):
        # stage needs loaded weights; an awake engine needs awake ranks
        await eng.ranks.call("wakeup", m.WakeupWorkerArgs(list(TAGS), target, s.load_strategy))
        done["woke"] = True
    if mismatch:
        uid = new_request_id()
        log.warning("ranks serve %s, the engine %r: bringing them to it", versions, target)
        try:
            await eng.ranks.call("stage", m.StageArgs(target, False, s.load_strategy, uid))
        except RankError:
            await control.settle(eng, "abort")
            raise
        try:
            await eng.ranks.call("commit", m.CommitArgs(target, uid))
        except RankError:
            await control.settle(eng, "rollback", m.UpdateIdArgs(uid))
            raise
        await eng.ranks.broadcast("finalize", m.UpdateIdArgs(uid))
        done["from"] = versions
    if st.asleep:
        await eng.ranks.call(
            "sleep", m.SleepWorkerArgs(sorted(st.asleep), s.shutdown_comm_group_if_worker_idle)
        )
        done["asleep"] = sorted(st.asleep)
    # the ranks' KV cache is not the one the scheduler planned for any more
    async with eng.scheduler.quiet():
        eng.scheduler.drop_kv()
    final = await eng.ranks.call("ping", timeout=quick)
    eng.rank_pids = {r: int(rep.result.get("pid", 0)) for r, rep in final.items()}
    bad = {r: rep.result.get("version") for r, rep in final.items()}
    if target and any(v != target for v in bad.values()):
        raise ControlError(503, f"reconcile: ranks still serve {bad}, the engine {target!r}")
    return done


def busy_rank(replies: dict[int, m.WorkerReply]) -> str:
    """A rank whose compute thread has run one job for ``DRAIN_S`` or longer (its last
    ``status``), said as the reason not to reconcile now: a ``drain`` queued behind that
    job would not answer within the bound. "" when every compute thread is free."""
    for r, rep in sorted(replies.items()):
        busy_s = float(rep.result.get("busy_s") or 0.0)
        if busy_s >= DRAIN_S:
            job = rep.result.get("busy") or "a job"
            return f"rank {r}'s compute thread has run {job} for {busy_s:.1f} s"
    return ""


def ranks_changed(eng: Engine, replies: dict[int, m.WorkerReply]) -> str:
    """Why pinged ranks need :func:`reconcile`: ``"restarted"`` (not the pids the engine
    reconciled: the launcher restarted them), ``"version"`` (a rank serves another
    version than the engine), else ``""``."""
    pids = {r: int(rep.result.get("pid", 0)) for r, rep in replies.items()}
    if eng.rank_pids and pids != eng.rank_pids:
        return "restarted"
    target = eng.state.weight_version
    if target and any(rep.result.get("version") != target for rep in replies.values()):
        return "version"
    return ""
