"""The engine process: ``python -m services.engine``.

Owns the state machine, the control lock, the scheduler and step loop, and the fan-out
to the ranks. Serves ``rollbus.<i>.ctl.<method>`` (plain JSON in, control reply out)
as the NATS micro service ``rollbus-engine``, and records every control operation and
state change on ``rollbus.<i>.events.<kind>`` (JetStream stream ``ROLLBUS_EVENTS``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from services.engine import autoupdate, control, membership, persist
from services.engine import fleet as fleet_ctl
from services.engine.generation import Generation
from services.engine.ranks import RankError, Ranks
from services.engine.state import EngineState, State
from shared import fleet as fleet_msgs
from shared import messages as m
from shared import objstore
from shared.bus import (
    DEADLINE,
    MAX_REQUEST_ID_BYTES,
    REQUEST_ID,
    Bus,
    new_request_id,
    unreadable_deadline,
)
from shared.errors import (
    BAD_REQUEST,
    CONFLICT,
    INTERNAL,
    NOT_FOUND,
    UNPROCESSABLE,
    ControlError,
)
from shared.redact import public_url
from shared.settings import Settings, settings_or_exit
from shared.subjects import Subjects
from shared.tasks import Supervisor, run_loop

log = logging.getLogger("rollbus.engine")

FRESH_START_ENV = "ROLLBUS_ENGINE_FRESH_START"  # set by the launcher on a stack's first start

ACTOR = "Rollbus-Actor"
Method = Callable[..., Any]

# method -> (handler, argument type, takes the control lock)
METHODS: dict[str, tuple[Method, type, bool]] = {
    "pause": (control.pause, m.PauseArgs, True),
    "resume": (control.resume, m.NoArgs, True),
    "is_paused": (control.is_paused, m.NoArgs, False),
    "sleep": (control.sleep, m.TagArgs, True),
    "wakeup": (control.wakeup, m.TagArgs, True),
    "update_weights": (control.update_weights, m.UpdateWeightsArgs, True),
    "status": (control.status, m.StatusArgs, False),
    "health": (control.health, m.NoArgs, False),
    "model_config": (control.model_config, m.NoArgs, False),
    # a fleet transaction, one step per call (services.engine.fleet)
    "fleet_stage": (fleet_ctl.fleet_stage, fleet_msgs.StageTxnArgs, True),
    "fleet_commit": (fleet_ctl.fleet_commit, fleet_msgs.TxnArgs, True),  # waits for the lock
    # these two wait for the control lock themselves (the watchdog may hold it)
    "fleet_finalize": (fleet_ctl.fleet_finalize, fleet_msgs.TxnArgs, False),
    "fleet_abort": (fleet_ctl.fleet_abort, fleet_msgs.TxnArgs, False),
}
# a rank serving another version than the engine is reported once every report of it
# says so for this long (README "Supervision and health")
MISMATCH_CONFIRM_S = 2.0
# exclusive methods that wait (up to CONTROL_TIMEOUT_S) for the lock instead of a 409: the
# instance's own fleet watchdog may hold it, resolving the same transaction
WAITS_FOR_LOCK = {"fleet_commit"}
# reads whose handler never awaits (plain functions of the engine's state): answered in
# their subscription's callback, as a rank answers ping/status — no task and no loop
# turn per call on the polled `is_paused`. The others (`status` may scatter to the ranks)
# each run in a task of their own, so one slow call does not hold back the next.
INLINE = {"is_paused", "health", "model_config"}


class Engine:
    def __init__(self, settings: Settings, bus: Bus) -> None:
        self.settings = settings
        self.bus = bus
        self.subjects = Subjects(settings.instance)
        self.state = EngineState()
        self.ranks = Ranks(
            bus, self.subjects, settings.tp, settings.control_timeout_s, settings.rank_refresh_s
        )
        self.lock = asyncio.Lock()
        self.ready = False
        self.ranks_alive = False
        # took its state back from the KV bucket (restarted beside live ranks): its
        # auto-update resumes from its durable, with no catch-up to the newest version
        self.restored = False
        self.latest_published = ""
        # the version auto-update waits for the files of (no pause meanwhile): {version,
        # reason, since}, else None — /v1/status's `auto_update_waiting`
        self.auto_update_waiting: dict[str, Any] | None = None
        # why auto-update cannot follow its feed (a refused pull or version listing, no
        # JetStream): {reason, since}, None once a fetch succeeds — `auto_update_error`
        self.auto_update_error: dict[str, Any] | None = None
        self.max_model_len = 0
        self.supervisor = Supervisor("engine")
        # what each rank said in the watcher's last round (version, compute-thread
        # watermark); ``status`` answers from ``ranks.view``, fed by the same rounds
        self.rank_pings: dict[int, dict[str, Any]] = {}
        self.ranks_error = ""
        self.version_mismatch: dict[int, str] = {}  # rank -> version, when not ours
        self._mismatch_seen: dict[int, tuple[str, float]] = {}  # rank -> (version, since)
        self.scheduler = Generation(self)
        self.persist = persist.Persister(self)
        self.fleet = fleet_ctl.Fleet(self)
        self.rank_pids: dict[int, int] = {}  # the ranks last brought to the engine's state

    @functools.cached_property
    def fixed_status(self) -> dict[str, Any]:
        """The ``status`` fields that never change in the engine's life, computed once
        (the served model name resolves the model dir's path: most of a status' cost)."""
        pid = os.getpid()
        return {
            "model": self.settings.served_model_name,
            "instance": self.settings.instance,
            "engine_pid": pid,
            "tp": self.settings.tp,
            "load_strategy": self.settings.load_strategy,
            "nats_url": public_url(self.bus.url),  # never credentials
            "pid": pid,
        }

    # ------------------------------------------------------------------ events

    async def event(self, kind: str, data: dict[str, Any], request_id: str = "") -> None:
        """Append to the audit log. A core publish: JetStream stores it without a
        round-trip ack on the control path."""
        ev = m.Event(
            kind=kind,
            instance=self.settings.instance,
            request_id=request_id,
            actor="engine",
            data=data,
        )
        try:
            await self.bus.publish(self.subjects.event(kind), m.json_encode(ev))
        except Exception:  # the audit log must never fail a control op
            log.exception("could not publish event %s", kind)

    async def state_changed(self, to: str, data: dict[str, Any]) -> None:
        await self.event("state", {"state": to, **data})
        self.persist.state_changed(to, data)
        await self.persist.save()

    # ------------------------------------------------------------------ control

    async def dispatch(self, method: str, data: bytes, headers: dict[str, str]) -> bytes:
        rid = headers.get(REQUEST_ID) or new_request_id()
        long_rid = len(rid.encode()) > MAX_REQUEST_ID_BYTES
        if long_rid:  # not echoed (``Bus.serve``): the reply would not fit max_payload
            rid = new_request_id()
        actor = m.clip(headers.get(ACTOR, "nats"), 256)
        fn, argtype, exclusive = METHODS[method]
        t0 = time.perf_counter()
        args: Any = None
        try:
            if long_rid:
                raise ControlError(
                    BAD_REQUEST,
                    f"header {REQUEST_ID} longer than {MAX_REQUEST_ID_BYTES} bytes",
                    {"param": REQUEST_ID},
                )
            if bad := unreadable_deadline(headers):  # not run: we cannot tell if it is late
                raise ControlError(
                    BAD_REQUEST,
                    f"{bad}: not unix epoch milliseconds (an integer); not run",
                    {"param": DEADLINE},
                )
            args = m.decode_args(data, argtype)
            if exclusive:
                if method in WAITS_FOR_LOCK:
                    wait = self.settings.control_timeout_s
                    try:
                        await asyncio.wait_for(self.lock.acquire(), wait)
                    except TimeoutError:
                        raise ControlError(
                            CONFLICT,
                            f"{method}: another control operation is in progress "
                            f"(waited {wait:g}s)",
                        ) from None
                elif self.lock.locked():
                    raise ControlError(
                        CONFLICT, f"{method}: another control operation is in progress"
                    )
                else:
                    await self.lock.acquire()
                try:
                    result = await self._call(fn, args, actor)
                finally:
                    self.lock.release()
            else:
                result = await self._call(fn, args, actor)
            reply = m.ControlReply(rid, result=result)
        except ControlError as e:
            reply = m.ControlReply(rid, e.code, m.clip(e.message), _jsonable(e.result))
        except Exception as e:  # a bug must answer, not leave the caller to time out
            log.exception("%s failed", method)
            reply = m.ControlReply(rid, INTERNAL, f"{method}: internal error: {e!r}")
        if exclusive:
            await self.persist.save()  # e.g. a partial wakeup changes no state name
            await self.event(
                "control",
                {
                    "method": method,
                    "args": m.to_builtins(args),
                    "error_code": reply.error_code,
                    "error_message": reply.error_message,
                    "actor": actor,
                    "seconds": time.perf_counter() - t0,
                },
                rid,
            )
        return m.json_encode(reply)

    async def _call(self, fn: Method, args: Any, actor: str) -> dict[str, Any]:
        if fn in TAKES_ACTOR:
            out = fn(self, args, actor=actor)
        else:
            out = fn(self, args)
        if isinstance(out, Awaitable):
            out = await out
        return out

    async def start(self) -> None:
        await objstore.ensure_events_stream(self.bus.nc, self.subjects.event(">"))
        # the checkpoint stream and bucket are created here, with fixed subjects: the
        # trainer may write into them but not create or reconfigure a stream (README Security)
        await objstore.ensure_ckpt_stream(self.bus.nc, self.settings.model_name or "")
        await objstore.ensure_bucket(self.bus.nc, self.settings.ckpt_bucket)
        # fleet transaction records (shared.fleet): API and operator may not create it
        await fleet_msgs.ensure_bucket(self.bus.nc, objstore.replicas_for(self.bus.nc))
        svc = await self.bus.add_service(
            fleet_msgs.SERVICE,
            "0.1.0",
            f"rollbus engine ({self.settings.instance})",
            # fleet discovery ($SRV.PING) and its model filter
            metadata={"instance": self.settings.instance, "model": self.settings.served_model_name},
        )
        for method in METHODS:
            await self.bus.serve(
                svc,
                method,
                self.subjects.ctl(method),
                lambda d, h, _m=method: self.dispatch(_m, d, h),
                queue="engine",
                concurrent=method not in INLINE,
                # a call whose caller already gave up (its 503 said "failed") never runs
                # later, e.g. re-sent by nats-py after a reconnect (README Bus contract)
                deadline=True,
            )
        await self.scheduler.start(svc)
        await self.bus.flush()

    async def wait_ranks(self) -> None:
        """Ping until every rank answers once. Then take the stored state (KV bucket
        ``rollbus_state``) and bring the ranks to it; on a first start (nothing stored)
        learn the serving version from the ranks."""
        # a fresh `rollbus serve` starts from the model dir like any server; only an engine
        # restarted beside live ranks (by the launcher) takes the stored state back
        fresh = os.environ.get(FRESH_START_ENV) == "1"
        record = None if fresh else await self.persist.load()
        update = persist.apply(self, record) if record is not None else None
        restored = update
        self.restored = record is not None
        while True:
            try:
                replies = await self.ranks.poll(timeout=1.0)
            except ControlError:
                await asyncio.sleep(0.2)
                continue
            if record is None:
                versions = {rep.result.get("version") for rep in replies.values()}
                if len(versions) != 1:
                    raise ControlError(INTERNAL, f"ranks serve different versions: {versions}")
                self.state.weight_version = versions.pop() or ""
                self.rank_pids = {r: int(rep.result.get("pid", 0)) for r, rep in replies.items()}
                break
            log.info("restoring %s on %s", self.state.state.value, self.state.weight_version)
            if await self.bring_ranks(update, "restore"):
                break
            update = None  # rolled back (or tried): the ranks' versions decide from here
            await asyncio.sleep(1.0)
        if restored is not None and restored.fleet_txn:
            await fleet_ctl.restored(self, restored)  # follows the transaction's record
        await self.persist.save()
        await self.ranks.refresh()  # `status` from the first call on shows the ranks as they are
        self.ready = self.ranks_alive = True
        await self.event("ready", {"version": self.state.weight_version, "tp": self.settings.tp})

    async def bring_ranks(self, update: persist.Update | None, why: str) -> bool:
        """:func:`persist.reconcile` under the control lock; False (logged) if it failed.

        If the engine's version cannot be loaded any more (deleted: 400/404/422), the
        engine takes the version every rank serves instead (logged at ERROR, event
        ``version_lost``): serving on, with truthful version labels, beats a stack that
        can never be ready."""
        async with self.lock:
            try:
                done = await persist.reconcile(self, update)
            except ControlError as e:
                log.warning("could not bring the ranks to the engine's state (%s): %s", why, e)
                await self.event("reconcile", {"ok": False, "why": why, "error": e.message})
                if e.code in (BAD_REQUEST, NOT_FOUND, UNPROCESSABLE):
                    await self._adopt_ranks_version(e)
                return False
            finally:
                await self.ranks.refresh()
        log.info("ranks brought to the engine's state (%s): %s", why, done)
        await self.event("reconcile", {"ok": True, "why": why, **done})
        return True

    async def _adopt_ranks_version(self, err: ControlError) -> None:
        try:
            replies = await self.ranks.call("ping", timeout=2.0)
        except ControlError:
            return
        versions = {str(rep.result.get("version") or "") for rep in replies.values()}
        lost = self.state.weight_version
        if len(versions) != 1 or lost in versions:
            return
        self.state.weight_version = versions.pop()
        log.error(
            "version %r cannot be loaded (%s): serving the ranks' %r instead",
            lost,
            err.message,
            self.state.weight_version,
        )
        await self.event("version_lost", {"lost": lost, "version": self.state.weight_version})
        await self.persist.save()

    async def watch_ranks(self) -> None:
        """Every ``RANK_REFRESH_S``, ask every rank's ``status`` (one scatter, answered on
        each rank's event loop, never queued behind its compute thread): the view
        ``status`` answers from (``ranks.view``, each answer recorded as it arrives).
        Rounds overlap: a silent rank holds its round up to the view's staleness bound,
        the others are still asked every period. Each round, in order: keep
        ``ranks_alive`` true only while every rank answers and serves the engine's state
        (ranks that come back restarted are brought to it first); keep each rank's last
        report (version, compute-thread watermark) for ``problems``."""
        period = self.settings.rank_refresh_s
        rounds: deque[asyncio.Future[tuple[dict[int, m.WorkerReply], str]]] = deque()
        asked = asyncio.Event()

        async def ask() -> None:
            while True:
                await asyncio.sleep(period)
                rounds.append(asyncio.ensure_future(self._round()))
                asked.set()

        async def handle() -> None:
            while True:
                if not rounds:
                    asked.clear()
                    await asked.wait()
                    continue
                replies, error = await rounds[0]
                rounds.popleft()
                # behind (a reconcile took long): only the newest finished round counts
                while rounds and rounds[0].done():
                    replies, error = rounds.popleft().result()
                await self._watched(replies, error)

        tasks = [asyncio.ensure_future(ask()), asyncio.ensure_future(handle())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in [*tasks, *rounds]:
                t.cancel()

    async def _round(self) -> tuple[dict[int, m.WorkerReply], str]:
        try:
            return await self.ranks.poll(), ""
        except RankError as e:
            return e.replies, e.message

    async def _watched(self, replies: dict[int, m.WorkerReply], error: str) -> None:
        alive = not error
        if not alive and self.ranks_alive:
            log.warning("ranks lost: %s", error)
            await self.event("ranks", {"alive": False, "error": error})
        # a rank whose compute thread is stuck in one job would hold reconcile's drain
        # (and the control lock) to its bound every round: wait until it is free
        busy = persist.busy_rank(replies) if alive else ""
        if alive and persist.ranks_changed(self, replies) == "restarted":
            # new rank processes (the launcher restarted them): brought to the engine's
            # version and sleep state before they count as alive. A rank switched
            # behind the engine's back is only reported (``_check_versions``).
            if self.lock.locked() or busy:  # the lock held, or a rank busy: next round
                why = f" ({busy})" if busy else ""
                error = f"ranks restarted: not yet brought to the engine's state{why}"
                alive = False
            elif not await self.bring_ranks(None, "restarted"):
                alive, error = False, "ranks restarted: not brought to the engine's state"
        elif alive and self.ranks.unsettled and self.state.state is not State.UPDATING:
            # a call that changes the ranks found one silent (stopped, cut off): once all
            # answer again, they are brought back to the engine's state — what that rank
            # did late, or the undo it missed, is overridden (README Recovery)
            why = f"after a failed call ({self.ranks.unsettled})"
            seen = self.ranks.unsettled_n
            if self.lock.locked() or busy:  # the lock held, or a rank busy: next round
                why += f": {busy}" if busy else ""
                alive, error = False, f"ranks not yet brought to the engine's state {why}"
            elif await self.bring_ranks(None, why):
                self.ranks.settled(seen)
            else:
                alive, error = False, f"ranks not brought to the engine's state {why}"
        self.rank_pings = {r: rep.result for r, rep in replies.items()}
        self.ranks_alive, self.ranks_error = alive, error
        await self._check_versions()

    async def _check_versions(self) -> None:
        """Ranks serving another version than ours, the same one in every report for
        ``MISMATCH_CONFIRM_S`` (an update switches the ranks a moment before the
        engine; a rollback broadcast lands a moment after it). Not checked while
        updating, nor asleep (wakeup loads the engine's version, whatever ranks hold)."""
        ours = self.state.weight_version
        now = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}
        if self.state.state not in (State.UPDATING, State.SLEEPING):
            for r, p in self.rank_pings.items():
                if p.get("version", ours) != ours:
                    v = str(p.get("version", ""))
                    before = self._mismatch_seen.get(r)
                    seen[r] = (v, before[1] if before and before[0] == v else now)
        confirmed = {r: v for r, (v, t) in seen.items() if now - t >= MISMATCH_CONFIRM_S}
        self._mismatch_seen = seen
        if confirmed != self.version_mismatch:
            self.version_mismatch = confirmed
            if confirmed:
                log.error("ranks serve another version than the engine (%s): %s", ours, confirmed)
            await self.event(
                "version_mismatch",
                {"engine": ours, "ranks": {str(r): v for r, v in confirmed.items()}},
            )

    def problems(self, entries: list[dict[str, Any]] | None = None) -> list[str]:
        """Why the engine is not healthy now (empty when it is): what ``/health`` says.
        ``entries``: ``ranks.view.entries()`` the caller just took (``status``: one look
        at the ranks for both its ``ranks`` and its ``problems``)."""
        out: list[str] = []
        if not self.ready:
            out.append("engine not ready: waiting for the ranks")
        elif not self.ranks_alive:
            out.append(self.ranks_error or "ranks not answering")
        else:  # what `status` shows: a rank silent past the view's bound is not alive
            out += [
                f"rank {e['rank']} not answering: {e['reason']}"
                for e in (self.ranks.view.entries() if entries is None else entries)
                if not e["alive"]
            ]
        stall = self.scheduler.stall()
        if stall:
            out.append(stall)
        limit = self.settings.stall_s
        for r, p in sorted(self.rank_pings.items()):
            job, busy = str(p.get("busy", "")), float(p.get("busy_s", 0.0))
            if job.startswith("step") and busy >= limit:
                out.append(f"rank {r}: compute thread stuck in {job} for {busy:.0f}s")
        if self.version_mismatch:
            ranks = ", ".join(f"rank {r} serves {v!r}" for r, v in self.version_mismatch.items())
            ours = self.state.weight_version
            out.append(f"version mismatch: {ranks}; the engine serves {ours!r}")
        fleet = self.fleet.problem()
        if fleet:
            out.append(fleet)
        for name in self.supervisor.report()["down"]:
            err = self.supervisor.last_error.get(name, "")
            out.append(f"task {name} failed ({err}); restarting")
        return out


def _jsonable(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if not result:
        return None
    return {k: v for k, v in result.items() if k != "replies"}


# control functions that record who called them (looked up once, not per call)
TAKES_ACTOR = {fn for fn, _, _ in METHODS.values() if "actor" in inspect.signature(fn).parameters}


async def amain(settings: Settings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bus = await Bus.connect(settings.nats_url, "rollbus-engine")
    engine = Engine(settings, bus)
    await engine.start()
    # fleet membership record (services.engine.membership), also while the ranks come up
    engine.supervisor.start("fleet_member", lambda: membership.run(engine))
    # wait for the ranks, but a stop request must end the engine even if none ever comes
    ready = asyncio.ensure_future(engine.wait_ranks())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        await engine.supervisor.stop()
        await membership.leave(engine)
        await bus.close()
        return 0
    stopping.cancel()
    ready.result()
    log.info("engine ready: %d ranks, version %s", settings.tp, engine.state.weight_version)
    sup = engine.supervisor
    sup.start("watch_ranks", engine.watch_ranks)
    sup.start("persist", engine.persist.run)
    engine.scheduler.background(sup)
    sup.start("versions_track", lambda: autoupdate.track(engine))
    if settings.auto_update:
        sup.start("auto_update", lambda: autoupdate.follow(engine))
    await stop.wait()
    await sup.stop()
    await engine.scheduler.shutdown()  # live requests end now, not at their idle timeout
    await membership.leave(engine)
    await bus.close()
    return 0


def main() -> int:
    settings = settings_or_exit("rollbus-engine")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s engine %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run_loop(amain(settings))
    except ControlError as e:
        print(f"rollbus-engine: {e.message}", file=sys.stderr)
        return 1
