"""This engine's part of a fleet transaction (``shared.fleet`` has the protocol).

Control methods, each under the engine's control lock like every mutating call:

* ``fleet_stage {txn, version, pause_mode, verify_checksum}`` — pause (if running), state
  ``updating`` (persisted with the transaction id), stage on every rank. The engine stays
  ``updating`` with the version staged: nothing else may change it meanwhile (409).
* ``fleet_commit {txn}`` — only when the record says ``commit``: every rank swaps the new
  weights in and keeps the old ones (a failure rolls this instance's ranks back).
* ``fleet_finalize {txn}`` — only when the record says ``done`` (CAS from ``commit``):
  old weights freed, the engine takes the version and resumes if the transaction paused it.
* ``fleet_abort {txn}`` — only when the record says ``abort`` (CAS from ``staged``): ranks
  drop the staged weights or swap back; the engine resumes on its version.

A watchdog per transaction: no word from the coordinator for ``CONTROL_TIMEOUT_S`` after
the last step, and the engine follows the record itself (CAS ``staged`` -> ``abort`` or
``commit`` -> ``done``, then does what the record says). An engine restarted in the
middle of a transaction (the state record names it) rolls its ranks back as for any
interrupted update, stays ``updating`` and follows the record the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.engine import control, persist
from services.engine.ranks import RankError
from services.engine.state import State
from shared import fleet as f
from shared import messages as m
from shared.errors import CONFLICT, UNAVAILABLE, ControlError
from shared.versions import check_version_arg

if TYPE_CHECKING:
    from services.engine.main import Engine

log = logging.getLogger("rollbus.engine.fleet")


@dataclass
class Txn:
    txn: str
    uid: str  # the ranks' update id
    version: str
    previous: str
    resume: bool  # the transaction paused a running engine
    phase: str  # staged | committed | failed (commit failed, ranks rolled back) | restored
    deadline: float  # monotonic: when the watchdog asks the record
    task: asyncio.Task[None] | None = None
    asking_since: float = 0.0  # monotonic: the watchdog's first failed read of the record


class RecordMismatch(ControlError):
    """The record is not this instance's transaction (another txn, version or instance
    list than it staged): a 409, and nothing changes."""

    def __init__(self, message: str) -> None:
        super().__init__(CONFLICT, message)


def check_record(eng: Engine, txn: Txn, rec: f.Record) -> None:
    """The record names what this instance staged: its txn, its version, this instance
    among ``instances``. Else :class:`RecordMismatch` (a forged or foreign record)."""
    me = eng.settings.instance
    why = []
    if rec.txn != txn.txn:
        why.append(f"its txn is {rec.txn!r}")
    if rec.version != txn.version:
        why.append(f"its version is {rec.version!r}, staged here {txn.version!r}")
    if me not in rec.instances:
        why.append(f"instance {me!r} is not in its instances {rec.instances}")
    if why:
        raise RecordMismatch(
            f"fleet transaction {txn.txn}: the record is not this transaction's ("
            + "; ".join(why) + "): nothing changed"
        )


class Fleet:
    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.txn: Txn | None = None
        self.bucket = f.FleetBucket(eng.bus.nc)

    def describe(self) -> dict[str, Any] | None:
        t = self.txn
        return None if t is None else {"txn": t.txn, "version": t.version, "phase": t.phase}

    def start(self, txn: Txn) -> None:
        self.txn = txn
        txn.task = asyncio.create_task(_watch(self.eng, txn), name=f"fleet-{txn.txn}")

    def touch(self, txn: Txn) -> None:
        """The watchdog's window from now: ``CONTROL_TIMEOUT_S`` while staged; past that
        (committed, commit failed, restarted) longer than the coordinator waits for every
        commit (``CONTROL_TIMEOUT_S`` + 5 s), so a live coordinator that saw a commit fail
        decides (abort) before an instance would finish the transaction itself."""
        ct = self.eng.settings.control_timeout_s
        window = ct if txn.phase == "staged" else 2 * ct + 5.0
        txn.deadline = time.monotonic() + window

    def clear(self, txn: Txn) -> None:
        if self.txn is txn:
            self.txn = None
        if txn.task is not None and txn.task is not asyncio.current_task():
            txn.task.cancel()

    def require(self, txn_id: str) -> Txn:
        t = self.txn
        if t is None or t.txn != txn_id:
            held = f" (this instance is in {t.txn})" if t else ""
            raise ControlError(CONFLICT, f"fleet transaction {txn_id} is not staged here{held}")
        return t

    def problem(self) -> str:
        """For ``/health``: a transaction whose record the watchdog cannot read."""
        t = self.txn
        if t is None or not t.asking_since:
            return ""
        return (f"fleet transaction {t.txn} undecided for "
                f"{time.monotonic() - t.asking_since:.0f}s (its record cannot be read)")

    async def decide(self, txn: Txn, to: str) -> f.Record | None:
        """CAS ``to`` on the record of ``txn`` after :func:`check_record` (only ``done``
        needs it: an abort is always safe here). An invalid key decides nothing: abort."""
        from nats.js.errors import InvalidKeyError

        txn_id = txn.txn
        check = (lambda rec: check_record(self.eng, txn, rec)) if to == "done" else None
        try:
            return await self.bucket.decide(
                txn_id, to, "instance", f"instance {self.eng.settings.instance}", check
            )
        except ControlError:
            raise
        except InvalidKeyError:  # cannot have a record: it can only be abort
            log.error("fleet %s: not a valid record key: aborting here", txn_id)
            return f.Record(txn_id, txn.version, [], "abort", reason="invalid key")
        except Exception as e:  # noqa: BLE001 - the bucket is unreachable: nothing decided
            raise ControlError(
                UNAVAILABLE, f"cannot read the fleet record {txn_id} ({f.FLEET_BUCKET}): {e!r}"
            ) from None


def _result(eng: Engine, **extra: Any) -> dict[str, Any]:
    return {
        "instance": eng.settings.instance,
        "state": eng.state.state.value,
        "weight_version": eng.state.weight_version,
        **extra,
    }


async def _resume(eng: Engine) -> None:
    if eng.state.state is State.PAUSED:
        await control.resume(eng, m.NoArgs())


async def fleet_stage(eng: Engine, args: f.StageTxnArgs) -> dict[str, Any]:
    # over NATS too, before the engine pauses or turns updating: a path component
    check_version_arg(args.version)
    fl = eng.fleet
    if fl.txn is not None:
        raise ControlError(CONFLICT, f"fleet transaction {fl.txn.txn} is in progress")
    if eng.state.state is State.UPDATING:
        raise ControlError(CONFLICT, "another update_weights is in progress")
    was_running = eng.state.state is State.RUNNING
    t0 = time.perf_counter()
    if was_running:
        await control.pause(eng, m.PauseArgs(args.pause_mode))
    try:
        async with eng.scheduler.quiet():
            uid, previous = await control.begin_update(
                eng, args.version, {"fleet_txn": args.txn, "resume": was_running}
            )
            try:
                staged = await control.stage_ranks(eng, args.version, args.verify_checksum, uid)
            except BaseException:
                await control.end_update(eng, None)
                raise
    except BaseException:
        if was_running:
            await _resume(eng)
        raise
    txn = Txn(args.txn, uid, args.version, previous, was_running, "staged", 0.0)
    fl.touch(txn)
    fl.start(txn)
    ranks = [staged[r].result for r in sorted(staged)]
    return _result(
        eng, txn=args.txn, version=args.version, previous_version=previous,
        stage_s=time.perf_counter() - t0, ranks=ranks,
    )


async def _record(eng: Engine, txn_id: str) -> f.Record | None:
    try:
        got = await eng.fleet.bucket.get(txn_id)
    except f.BadRecord as e:
        raise ControlError(CONFLICT, f"{e}: no commit") from None
    except Exception as e:  # noqa: BLE001 - cannot see the decision: no commit
        raise ControlError(UNAVAILABLE, f"cannot read the fleet record {txn_id}: {e!r}") from None
    return got[0] if got else None


async def fleet_commit(eng: Engine, args: f.TxnArgs) -> dict[str, Any]:
    fl = eng.fleet
    t = fl.txn
    if (t is None or t.txn != args.txn) and eng.state.state is not State.UPDATING:
        # already resolved here (its watchdog waited for no one): the record says how
        rec = await _record(eng, args.txn)
        if (rec is not None and rec.decision == "done" and rec.txn == args.txn
                and eng.settings.instance in rec.instances
                and eng.state.weight_version == rec.version):
            return _result(eng, txn=args.txn, committed=rec.version, finalized=True)
    txn = fl.require(args.txn)
    if txn.phase == "restored":
        raise ControlError(UNAVAILABLE, f"fleet transaction {txn.txn}: instance "
                           f"{eng.settings.instance} restarted during the transaction")
    if txn.phase != "staged":
        raise ControlError(CONFLICT, f"fleet transaction {txn.txn} is {txn.phase}, not staged")
    rec = await _record(eng, txn.txn)
    decision = rec.decision if rec is not None else "missing"
    if decision not in ("commit", "done"):  # no commit without a written decision
        raise ControlError(
            CONFLICT, f"fleet transaction {txn.txn}: the record says {decision!r}, not 'commit'"
        )
    assert rec is not None
    check_record(eng, txn, rec)
    async with eng.scheduler.quiet():
        try:
            await control.commit_ranks(eng, txn.version, txn.uid, txn.previous)
        except ControlError:
            txn.phase = "failed"
            fl.touch(txn)
            raise
        finally:
            await eng.ranks.refresh()  # `status` right after shows the ranks' version
    txn.phase = "committed"
    fl.touch(txn)
    return _result(eng, txn=txn.txn, committed=txn.version)


async def fleet_finalize(eng: Engine, args: f.TxnArgs, actor: str = "") -> dict[str, Any]:
    """Waits for the control lock (the watchdog may hold it, resolving the same
    transaction) instead of answering 409: the outcome is the record's either way."""
    async with eng.lock:
        return await _finalize(eng, args, actor)


async def _finalize(eng: Engine, args: f.TxnArgs, actor: str) -> dict[str, Any]:
    fl = eng.fleet
    txn = fl.txn
    if txn is None or txn.txn != args.txn:  # already resolved (e.g. by the watchdog)
        return _result(eng, finalized=False)
    rec = await fl.decide(txn, "done")  # checked first: a foreign record changes nothing
    if rec is None or rec.decision == "abort":
        rolled = await finish_abort(eng, txn)
        return _result(eng, finalized=False, rolled_back=rolled)
    if rec.decision != "done":
        raise ControlError(CONFLICT, f"fleet transaction {txn.txn}: the record says "
                           f"{rec.decision!r}: not finalized")
    await finish_commit(eng, txn, actor)
    return _result(eng, finalized=True)


async def fleet_abort(eng: Engine, args: f.TxnArgs) -> dict[str, Any]:
    """Waits for the control lock, as :func:`fleet_finalize`."""
    async with eng.lock:
        return await _abort(eng, args)


async def _abort(eng: Engine, args: f.TxnArgs) -> dict[str, Any]:
    fl = eng.fleet
    txn = fl.txn
    if txn is None or txn.txn != args.txn:
        return _result(eng, aborted=False)
    rec = await fl.decide(txn, "abort")
    if rec is not None and rec.decision == "done":  # committed after all: follow the record
        try:
            check_record(eng, txn, rec)
        except RecordMismatch as e:  # a foreign record decides nothing: abort here
            log.error("%s: aborting here", e.message)
        else:
            await finish_commit(eng, txn, "fleet")
            return _result(eng, aborted=False)
        rec = None
    if rec is not None and rec.decision != "abort":
        raise ControlError(CONFLICT, f"fleet transaction {txn.txn}: the record says "
                           f"{rec.decision!r}: only its coordinator may abort it")
    rolled = await finish_abort(eng, txn)
    return _result(eng, aborted=True, rolled_back=rolled)


async def finish_commit(eng: Engine, txn: Txn, actor: str) -> None:
    """The record says ``done``: end on the new version, whatever phase we are in
    (a phase that lost its staged or committed weights loads the version again)."""
    fl = eng.fleet
    async with eng.scheduler.quiet():
        if txn.phase == "staged":
            try:
                await control.commit_ranks(eng, txn.version, txn.uid, txn.previous)
                txn.phase = "committed"
            except ControlError as e:
                log.warning("fleet %s: commit failed (%s): loading it again", txn.txn, e.message)
                txn.phase = "failed"
        if txn.phase == "committed":
            await eng.ranks.broadcast("finalize", m.UpdateIdArgs(txn.uid))
        await control.end_update(eng, txn.version)
        await control.switched(eng, txn.version, txn.previous, actor or "fleet")
    fl.clear(txn)
    if txn.phase in ("failed", "restored"):
        # the ranks are on the previous version: bring them forward to the engine's
        try:
            await persist.reconcile(eng)
        except ControlError as e:  # ranks gone: reconciled when they come back
            log.error("fleet %s: ranks not yet on %r: %s", txn.txn, txn.version, e.message)
        await eng.ranks.refresh()
    if txn.resume:
        await _resume(eng)
    await eng.event("fleet", {"txn": txn.txn, "outcome": "switched", "version": txn.version})


async def finish_abort(eng: Engine, txn: Txn) -> bool:
    """The record says ``abort``: drop what is staged or swap back, resume if we paused."""
    fl = eng.fleet
    rolled = False
    async with eng.scheduler.quiet():
        if txn.phase != "restored":  # a restored engine rolled its ranks back already
            try:
                reps = await eng.ranks.call("rollback", m.UpdateIdArgs(txn.uid))
                rolled = any(rep.result.get("rolled_back") for rep in reps.values())
            except RankError as e:  # silent ranks: told anyway; restarted ones reconcile
                log.warning("fleet %s: rollback: %s", txn.txn, e.message)
                await eng.ranks.broadcast("rollback", m.UpdateIdArgs(txn.uid))
        await control.end_update(eng, None)
    fl.clear(txn)
    if txn.resume:
        await _resume(eng)
    await eng.event(
        "fleet", {"txn": txn.txn, "outcome": "aborted", "version": eng.state.weight_version}
    )
    return rolled


async def _watch(eng: Engine, txn: Txn) -> None:
    """No word from the coordinator within ``CONTROL_TIMEOUT_S``: follow the record."""
    fl = eng.fleet
    while fl.txn is txn:
        delay = txn.deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
            continue
        async with eng.lock:
            if fl.txn is not txn:
                return
            if time.monotonic() < txn.deadline:
                continue
            try:
                rec = await fl.decide(txn, "abort")  # allowed from staged only
                if rec is not None and rec.decision == "done":
                    check_record(eng, txn, rec)
                if rec is not None and rec.decision == "commit":
                    rec = await fl.decide(txn, "done")
            except RecordMismatch as e:  # not our transaction's record: it decides nothing
                log.error("%s: aborting here", e.message)
                rec = f.Record(txn.txn, txn.version, [], "abort", reason="foreign record")
            except ControlError as e:
                log.warning("fleet %s: %s; asking again", txn.txn, e.message)
                txn.asking_since = txn.asking_since or time.monotonic()
                txn.deadline = time.monotonic() + 1.0
                continue
            decision = rec.decision if rec is not None else "missing"
            log.warning(
                "fleet %s: no word from the coordinator for %gs (%s): the record says %s",
                txn.txn, eng.settings.control_timeout_s, txn.phase, decision,
            )
            try:
                if decision == "done":
                    await finish_commit(eng, txn, "fleet-timeout")
                else:
                    await finish_abort(eng, txn)
            except Exception:
                log.exception("fleet %s: could not follow the record", txn.txn)
                txn.deadline = time.monotonic() + 1.0
                continue
            return


async def restored(eng: Engine, update: persist.Update) -> None:
    """At start, after the ranks were rolled back to the previous version: the engine
    was in fleet transaction ``update.fleet_txn``. Stay ``updating`` and follow the
    record (the coordinator's ``fleet_abort`` / ``fleet_finalize``, else the watchdog)."""
    async with eng.lock:
        eng.state.begin_update()
        await eng.state_changed(
            "updating",
            {
                "version": update.version,
                "from": eng.state.weight_version,
                "update_id": update.update_id,
                "fleet_txn": update.fleet_txn,
                "resume": update.resume,
            },
        )
        txn = Txn(
            update.fleet_txn, update.update_id, update.version, eng.state.weight_version,
            update.resume, "restored", 0.0,
        )
        eng.fleet.touch(txn)
        eng.fleet.start(txn)
    log.warning("fleet %s: restarted in the transaction; following its record", txn.txn)
