"""A fleet update: one weight update over every instance sharing a NATS, as one transaction.

The pure part (structs of the transaction record and the replies, the allowed decision
changes, the overall status) is unit-tested alone; the I/O part is the record's KV bucket
(:class:`FleetBucket`), discovery (:func:`discover`) and the coordinator
(:class:`Coordinator`), which the API (``POST /v1/fleet/update_weights``) and the CLI
(``rollbus fleet update``) both run.

Protocol (README "Fleet"):

1. the coordinator creates the record ``{txn, version, instances, decision: "staged"}``
   in the KV bucket ``rollbus_fleet`` (key = the transaction id);
2. ``ctl.fleet_stage`` on every instance at once: each pauses (if running) and stages the
   version on its ranks; its engine stays ``updating`` holding the staged weights;
3. any stage failure: the coordinator CAS-writes ``abort``; ``ctl.fleet_abort`` everywhere
   (staged weights dropped, each instance resumes on its version);
4. else it CAS-writes ``commit`` (from ``staged``) *before* any commit is sent, then
   ``ctl.fleet_commit`` everywhere (ranks swap in the new weights, keep the old ones);
5. all committed: CAS ``commit`` -> ``done``, then ``ctl.fleet_finalize`` everywhere (old
   weights freed, resumed). A commit failure: CAS ``commit`` -> ``abort``, then
   ``ctl.fleet_abort`` everywhere (every instance swaps back).

An instance that hears nothing more of its transaction for ``CONTROL_TIMEOUT_S`` follows
the record: it CAS-writes ``abort`` over ``staged``, or ``done`` over ``commit``, and does
what the record then says. Compare-and-set makes the first writer win, so a late
coordinator can no longer commit what an instance aborted, and every instance ends on the
same side.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from shared.bus import refusals
from shared.errors import BAD_REQUEST, CONFLICT, ControlError, PublishDenied
from shared.messages import PauseMode
from shared.versions import check_version_name

log = logging.getLogger("rollbus.fleet")

FLEET_BUCKET = "rollbus_fleet"
SERVICE = "rollbus-engine"
RECORD_TTL_S = 7 * 24 * 3600.0  # records of finished transactions expire after a week
DISCOVERY_S = 0.5
# membership (README "Fleet"): each engine keeps ``members.<instance>`` in the bucket fresh
# every CONTROL_TIMEOUT_S / MEMBER_REFRESH_DIV; a record counts for MEMBER_WINDOW_X x
# CONTROL_TIMEOUT_S after its last refresh (then a crashed instance drops out)
MEMBER_PREFIX = "members."
MEMBER_REFRESH_DIV = 3.0
MEMBER_WINDOW_X = 3.0

Decision = Literal["staged", "commit", "done", "abort"]
PAUSE_MODES = ("keep", "abort", "wait")
# a transaction id is a KV key: the alphabet new_txn_id() uses (and "-", "_")
TXN_PATTERN = "^[A-Za-z0-9_-]{1,64}$"

# (from, to) -> who may write it: "coordinator" or "any" (instances too)
TRANSITIONS: dict[tuple[str, str], str] = {
    ("staged", "commit"): "coordinator",
    ("staged", "abort"): "any",
    ("commit", "done"): "any",
    ("commit", "abort"): "coordinator",
}


def allowed(current: str, to: str, actor: str) -> bool:
    """Whether ``actor`` (``coordinator`` or ``instance``) may move the decision
    ``current`` -> ``to``. ``done`` and ``abort`` are final."""
    who = TRANSITIONS.get((current, to))
    return who == "any" or (who == "coordinator" and actor == "coordinator")


def committed(decision: str) -> bool:
    """The transaction's outcome is the new version (``commit`` may still turn ``abort``
    only by the coordinator, after a commit failed: see :data:`TRANSITIONS`)."""
    return decision == "done"


# ------------------------------------------------------------------ messages


class FleetUpdateArgs(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/fleet/update_weights`` body; also what ``rollbus fleet update`` sends."""

    version: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    pause_mode: PauseMode = "keep"
    verify_checksum: bool | None = None


class StageTxnArgs(msgspec.Struct, forbid_unknown_fields=True):
    """``ctl.fleet_stage``: pause (if running) and stage ``version`` for ``txn``."""

    txn: Annotated[str, msgspec.Meta(pattern=TXN_PATTERN)]
    version: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    pause_mode: PauseMode = "keep"
    verify_checksum: bool | None = None


class TxnArgs(msgspec.Struct, forbid_unknown_fields=True):
    """``ctl.fleet_commit`` / ``fleet_finalize`` / ``fleet_abort``."""

    txn: Annotated[str, msgspec.Meta(pattern=TXN_PATTERN)]


class Record(msgspec.Struct, forbid_unknown_fields=False):
    """The transaction record in the bucket, key = ``txn``."""

    txn: str
    version: str
    instances: list[str]
    decision: Decision = "staged"
    pause_mode: str = "keep"
    verify_checksum: bool | None = None
    coordinator: str = ""
    reason: str = ""  # who wrote the decision, and why
    created_at: float = 0.0
    updated_at: float = 0.0


class Outcome(msgspec.Struct, omit_defaults=False):
    """One instance's part of a fleet update, as the reply lists it."""

    instance: str
    outcome: str = "pending"  # switched | stayed | rolled_back | failed | unknown
    previous_version: str = ""
    version: str = ""  # the version it serves at the end, as it said
    error_code: int = 200
    error_message: str = ""
    phase: str = ""  # where it failed: stage | commit | finalize | abort


class FleetResult(msgspec.Struct, omit_defaults=False):
    txn: str
    version: str
    decision: str
    error_code: int
    error_message: str
    instances: list[Outcome]
    seconds: float = 0.0
    stage_s: float = 0.0
    commit_s: float = 0.0


def overall(outcomes: list[Outcome], decision: str, version: str) -> tuple[int, str]:
    """200 only if the transaction is done and every instance serves ``version`` (then
    whatever a step answered on the way: the record and the instances are the truth);
    else the status of the first failure (stage failures before commit failures, then
    by instance name), with every failing instance's message."""
    if decision == "done" and outcomes and all(o.version == version for o in outcomes):
        return 200, ""
    order = {"stage": 0, "commit": 1, "finalize": 2, "abort": 3, "": 4}
    failed = sorted(
        (o for o in outcomes if o.error_code != 200),
        key=lambda o: (order.get(o.phase, 5), o.instance),
    )
    if decision == "done" and not failed and all(o.version == version for o in outcomes):
        return 200, ""
    if failed:
        msg = "; ".join(f"{o.instance}: {o.error_message}" for o in failed)
        return failed[0].error_code, msg
    if decision == "abort":
        return 503, "transaction aborted (an instance did not hear from the coordinator in time)"
    stray = [o.instance for o in outcomes if o.version != version]
    return 503, f"instances {stray} do not serve {version!r}"


def status_rows(statuses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rollbus fleet status`` rows from each instance's ``ctl.status`` (or its error)."""
    rows = []
    for s in statuses:
        ranks = s.get("ranks") or []
        rows.append(
            {
                "instance": s.get("instance", ""),
                "model": s.get("model", ""),
                "state": s.get("state", "unreachable") if not s.get("error") else "unreachable",
                "version": s.get("weight_version", ""),
                "ranks": f"{sum(1 for r in ranks if r.get('alive'))}/{s.get('tp', len(ranks))}",
                "waiting": int(s.get("waiting", 0) or 0),
                "running": int(s.get("running", 0) or 0),
                "error": s.get("error", ""),
            }
        )
    return sorted(rows, key=lambda r: r["instance"])


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = ["instance", "model", "state", "version", "ranks", "waiting", "running"]
    table = [cols] + [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
             for row in table]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['instance']}: {r['error']}")
    return "\n".join(lines)


def new_txn_id() -> str:
    return "f" + uuid.uuid4().hex[:20]


# ------------------------------------------------------------------ membership (pure)


class Member(msgspec.Struct, forbid_unknown_fields=False):
    """An engine's membership record, key :func:`member_key` in the bucket."""

    instance: str
    model: str = ""
    pid: int = 0
    since: float = 0.0  # when this engine process registered
    last_seen: float = 0.0  # its last refresh (wall clock)


def member_key(instance: str) -> str:
    """``members.<instance>``, every character outside ``[A-Za-z0-9-]`` as ``_xx`` (hex;
    ``_xxxx`` beyond latin-1) so that any instance name is one valid KV key token."""
    out = []
    for ch in instance:
        if ch.isascii() and (ch.isalnum() or ch == "-"):
            out.append(ch)
        else:
            out.append(f"_{ord(ch):02x}" if ord(ch) < 256 else f"__{ord(ch):06x}")
    return MEMBER_PREFIX + "".join(out)


def member_period(control_timeout_s: float) -> float:
    """How often an engine refreshes its record."""
    return max(0.5, control_timeout_s / MEMBER_REFRESH_DIV)


def member_window(control_timeout_s: float) -> float:
    """How long after its last refresh a record still makes its instance a member."""
    return MEMBER_WINDOW_X * control_timeout_s


def member_live(m: Member, now: float, window: float) -> bool:
    return now - m.last_seen <= window


def merge(
    discovered: list[Instance], members: list[Member], now: float, window: float
) -> list[Instance]:
    """The fleet: every discovered instance, plus every member whose record is fresh
    (``now - last_seen <= window``) but that did not answer discovery (``reachable``
    False). The model is the discovered one's, else the record's. Sorted by name."""
    out = {i.instance: i for i in discovered}
    for m in members:
        if m.instance and m.instance not in out and member_live(m, now, window):
            out[m.instance] = Instance(m.instance, model=m.model, reachable=False)
    return [out[k] for k in sorted(out)]


def models_of(fleet: list[Instance]) -> list[str]:
    return sorted({i.model for i in fleet})


def select(fleet: list[Instance], model: str | None, instances: list[str] | None
           ) -> list[Instance]:
    """The instances a transaction covers: the named ones (``instances``; a name not in
    ``fleet`` is kept, it will fail as unreachable), else those serving ``model``, else
    all."""
    if instances is not None:
        by = {i.instance: i for i in fleet}
        return [by.get(n, Instance(n, reachable=False)) for n in sorted(set(instances))]
    if model is not None:
        return [i for i in fleet if i.model == model]
    return list(fleet)


def mark_unreachable(outcomes: list[Outcome], silent: set[str]) -> None:
    """An instance that answered neither discovery nor its calls (503) is ``unreachable``."""
    for o in outcomes:
        if o.instance in silent and o.error_code == 503:
            o.outcome = "unreachable"


class BadUpdateArg(ControlError, ValueError):
    """A bad fleet update argument (400 naming it), found before anything started."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(BAD_REQUEST, f"bad argument '{param}': {why}", {"param": param})


def check_update_args(version: str, pause_mode: str, verify_checksum: bool | None) -> None:
    """The arguments of a fleet update, checked before any record is written or any
    instance paused: :class:`BadUpdateArg` (a ``ValueError``, and a 400) naming the bad
    one."""
    try:
        check_version_name(version)
    except ControlError as e:
        raise BadUpdateArg("version", e.message) from None
    if pause_mode not in PAUSE_MODES:
        raise BadUpdateArg("pause_mode", f"{pause_mode!r} is not one of {', '.join(PAUSE_MODES)}")
    if verify_checksum is not None and not isinstance(verify_checksum, bool):
        raise BadUpdateArg("verify_checksum", "must be true, false or absent")


class BadRecord(ValueError):
    """A transaction record that exists but does not decode: it decides nothing."""


# ------------------------------------------------------------------ the record's bucket


class FleetBucket:
    """The transaction records (JetStream KV ``rollbus_fleet``). The engine creates the
    bucket (:func:`ensure_bucket`); API and operator only read and compare-and-set."""

    def __init__(self, nc: Any, timeout: float = 2.0) -> None:
        self.nc, self.timeout = nc, timeout
        self._kv: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await self.nc.jetstream(timeout=self.timeout).key_value(FLEET_BUCKET)
        return self._kv

    async def create(self, rec: Record) -> None:
        kv = await self._bucket()
        rec.created_at = rec.updated_at = time.time()
        await asyncio.wait_for(kv.create(rec.txn, msgspec.json.encode(rec)), self.timeout)

    async def get(self, txn: str) -> tuple[Record, int] | None:
        from nats.js.errors import KeyNotFoundError

        kv = await self._bucket()
        try:
            entry = await asyncio.wait_for(kv.get(txn), self.timeout)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        rev = int(entry.revision or 0)
        try:
            return msgspec.json.decode(entry.value, type=Record), rev
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadRecord(f"fleet record {txn} does not decode ({e}); revision {rev}") from None

    async def decide(
        self,
        txn: str,
        to: str,
        actor: str,
        reason: str,
        check: Callable[[Record], None] | None = None,
    ) -> Record | None:
        """Compare-and-set the decision to ``to`` when :func:`allowed`; returns the record
        as it is afterwards (someone else's decision if they were first), ``None`` if there
        is no record. ``check(record)`` may refuse (raise) before anything is written. A
        record that does not decode decides nothing: it is overwritten with ``abort``
        (compare-and-set, whatever ``to`` was) and that is returned."""
        from nats.js.errors import KeyWrongLastSequenceError

        kv = await self._bucket()
        for _ in range(20):
            try:
                got = await self.get(txn)
            except BadRecord as e:
                entry = await asyncio.wait_for(kv.get(txn), self.timeout)
                rec = Record(txn, "", [], "abort", reason=f"{reason}: {e}",
                             created_at=time.time(), updated_at=time.time())
                try:
                    await asyncio.wait_for(
                        kv.update(txn, msgspec.json.encode(rec), last=entry.revision),
                        self.timeout,
                    )
                    return rec
                except KeyWrongLastSequenceError:
                    continue
            if got is None:
                return None
            rec, rev = got
            if check is not None:
                check(rec)
            if rec.decision == to or not allowed(rec.decision, to, actor):
                return rec
            rec.decision = to  # type: ignore[assignment]
            rec.reason, rec.updated_at = reason, time.time()
            try:
                await asyncio.wait_for(
                    kv.update(txn, msgspec.json.encode(rec), last=rev), self.timeout
                )
                return rec
            except KeyWrongLastSequenceError:
                continue  # someone wrote first: read again
        raise RuntimeError(f"fleet record {txn}: compare-and-set kept losing")

    async def members(self) -> list[Member]:
        """Every membership record (deleted ones left out). Listed by the stream's
        per-subject info (no consumer: the API and operator roles may not create one)."""
        from nats.js.errors import KeyNotFoundError

        kv = await self._bucket()
        info = await asyncio.wait_for(
            self.nc.jetstream(timeout=self.timeout).stream_info(
                f"KV_{FLEET_BUCKET}", subjects_filter=f"$KV.{FLEET_BUCKET}.{MEMBER_PREFIX}>"
            ),
            self.timeout,
        )
        subjects = (info.state.subjects or {}) if info.state else {}
        out = []
        for subject in sorted(subjects):
            key = subject[len(f"$KV.{FLEET_BUCKET}."):]
            try:
                entry = await asyncio.wait_for(kv.get(key), self.timeout)
            except KeyNotFoundError:  # deleted (a clean shutdown)
                continue
            if not entry.value:
                continue
            try:
                out.append(msgspec.json.decode(entry.value, type=Member))
            except msgspec.DecodeError:
                log.warning("fleet: unreadable member record %s", key)
        return out

    async def put_member(self, m: Member) -> None:
        kv = await self._bucket()
        await asyncio.wait_for(kv.put(member_key(m.instance), msgspec.json.encode(m)),
                               self.timeout)

    async def delete_member(self, instance: str) -> None:
        kv = await self._bucket()
        await asyncio.wait_for(kv.delete(member_key(instance)), self.timeout)


async def ensure_bucket(nc: Any, replicas: int) -> None:
    """Create the ``rollbus_fleet`` bucket if missing (the engine does, at start)."""
    from nats.js import api
    from nats.js.errors import BadRequestError, NotFoundError

    js = nc.jetstream(timeout=5.0)
    try:
        await js.key_value(FLEET_BUCKET)
        return
    except (NotFoundError, BadRequestError):
        pass
    try:
        await js.create_key_value(
            api.KeyValueConfig(
                bucket=FLEET_BUCKET,
                history=1,
                ttl=RECORD_TTL_S,
                storage=api.StorageType.FILE,
                replicas=replicas,
            )
        )
    except BadRequestError:  # created concurrently by another engine
        await js.key_value(FLEET_BUCKET)


# ------------------------------------------------------------------ discovery


class Instance(msgspec.Struct):
    instance: str
    id: str = ""
    version: str = ""
    model: str = ""  # the served model name (service metadata ``model``, or member record)
    reachable: bool = True  # answered discovery (False: only its member record is fresh)


async def discover(nc: Any, window: float = DISCOVERY_S) -> list[Instance]:
    """Every engine answering ``$SRV.PING.rollbus-engine`` within ``window`` seconds, by
    the ``instance`` of its service metadata (one per name, sorted), with its ``model``.
    An instance too slow for ``window`` is missing here: :meth:`Coordinator.fleet` adds
    the members that did not answer. :class:`~shared.errors.PublishDenied` (403), at
    once, when the server refuses the ping (these credentials lack ``$SRV.>``, or the
    inbox is a reply subject it reserves): the ping reached no one, and "no instance"
    after the window would say the fleet is empty."""
    inbox = nc.new_inbox()
    ping = f"$SRV.PING.{SERVICE}"
    found: dict[str, Instance] = {}
    refused: asyncio.Future[PublishDenied] = asyncio.get_running_loop().create_future()

    def on_refused(e: PublishDenied) -> None:
        if not refused.done():
            refused.set_result(e)

    async def on_reply(msg: Any) -> None:
        try:
            doc = json.loads(msg.data)
        except ValueError:
            return
        meta = doc.get("metadata") or {}
        name = meta.get("instance")
        if doc.get("name") == SERVICE and name:
            found[name] = Instance(name, str(doc.get("id", "")), str(doc.get("version", "")),
                                   str(meta.get("model", "")))

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        with refusals(nc, ping, inbox, on_refused):
            await nc.publish(ping, b"", reply=inbox)
            await nc.flush()
            await asyncio.wait({refused}, timeout=window)
    finally:
        await sub.unsubscribe()
    if refused.done():
        raise refused.result()
    return [found[k] for k in sorted(found)]


# ------------------------------------------------------------------ the coordinator


class Coordinator:
    """Runs fleet transactions over a :class:`shared.bus.Bus` (any role allowed to call
    ``rollbus.*.ctl.fleet_*``, ``$SRV.>`` and the bucket: api, operator)."""

    def __init__(
        self,
        bus: Any,
        control_timeout_s: float,
        *,
        name: str = "",
        test_commit_delay_s: float = 0.0,
        discovery_s: float = DISCOVERY_S,
    ) -> None:
        self.bus = bus
        self.ct = control_timeout_s
        self.name = name or bus.name
        self.test_commit_delay_s = test_commit_delay_s
        self.discovery_s = discovery_s
        self.bucket = FleetBucket(bus.nc)

    async def fleet(self, ping: bool = True) -> list[Instance]:
        """Discovered instances plus fresh members that did not answer (:func:`merge`).
        Without a readable bucket, the discovered ones (logged). ``ping=False``: the
        fresh members only, no discovery window (each counted as reachable)."""
        found = await discover(self.bus.nc, self.discovery_s) if ping else []
        try:
            members = await self.bucket.members()
        except Exception as e:  # noqa: BLE001 - discovery alone is still an answer
            log.warning("fleet: cannot read the member records (%r)", e)
            members = []
        out = merge(found, members, time.time(), member_window(self.ct))
        if not ping:
            for i in out:
                i.reachable = True
        return out

    async def instances(self) -> list[str]:
        return [i.instance for i in await self.fleet()]

    async def call(
        self, instance: str, method: str, args: msgspec.Struct | None, timeout: float
    ) -> tuple[int, str, dict[str, Any]]:
        """``ctl.<method>`` on one instance: (code, message, result); never raises."""
        from shared.errors import ControlError
        from shared.messages import ControlReply
        from shared.subjects import Subjects

        data = msgspec.json.encode(args) if args is not None else b"{}"
        try:
            rep = await self.bus.request(
                Subjects(instance).ctl(method), data, timeout=timeout,
                headers={"Rollbus-Actor": f"fleet:{self.name}"},
            )
            reply = msgspec.json.decode(rep.data, type=ControlReply)
        except ControlError as e:
            return e.code, f"{method}: {e.message}", {}
        except Exception as e:  # noqa: BLE001 - one instance's failure is a reply, not a crash
            return 503, f"{method}: {e!r}", {}
        return reply.error_code, reply.error_message, dict(reply.result or {})

    async def status(self) -> list[dict[str, Any]]:
        insts = await self.fleet()
        t = min(10.0, self.ct + 2.0)
        replies = await asyncio.gather(
            *(self.call(i.instance, "status", None, t if i.reachable else min(t, 3.0))
              for i in insts)
        )
        out = []
        for i, (code, msg, res) in zip(insts, replies, strict=True):
            err = msg or str(code)
            if not i.reachable:
                err = f"did not answer discovery nor status ({err})"
            out.append(res if code == 200 else
                       {"instance": i.instance, "model": i.model, "error": err})
        return status_rows(out)

    async def update(
        self,
        version: str,
        pause_mode: str = "keep",
        verify_checksum: bool | None = None,
        instances: list[str] | None = None,
        model: str | None = None,
    ) -> FleetResult:
        """One transaction. ``instances``: exactly these (no discovery ping: a name
        without a fresh member record is the one counted unreachable); else the fleet's
        instances serving ``model`` (None: every instance, whatever it serves). Bad
        arguments raise :class:`BadUpdateArg` (a ``ValueError``) before any record is
        written or instance paused."""
        check_update_args(version, pause_mode, verify_checksum)
        t0 = time.perf_counter()
        chosen = select(await self.fleet(ping=instances is None), model, instances)
        names = [i.instance for i in chosen]
        silent = {i.instance for i in chosen if not i.reachable}
        txn = new_txn_id()
        outcomes = {n: Outcome(n) for n in names}
        if not names:
            what = f" serving model {model!r}" if model is not None and instances is None else ""
            return FleetResult(txn, version, "none", 503, f"no rollbus instance{what} answered "
                               f"$SRV.PING.{SERVICE}", [], time.perf_counter() - t0)
        rec = Record(txn, version, names, "staged", pause_mode, verify_checksum, self.name)
        try:
            await self.bucket.create(rec)
        except Exception as e:  # noqa: BLE001 - nothing started yet: refuse cleanly
            return FleetResult(txn, version, "none", 503,
                               f"cannot write the transaction record ({FLEET_BUCKET}): {e!r}",
                               list(outcomes.values()), time.perf_counter() - t0)
        log.info("fleet %s: staging %r on %s", txn, version, names)
        # stage: a pause that waits (mode wait) may take CONTROL_TIMEOUT_S before it
        stage_t = self.ct + 5.0 + (self.ct if pause_mode == "wait" else 0.0)
        args = StageTxnArgs(txn, version, pause_mode, verify_checksum)  # type: ignore[arg-type]
        staged = await asyncio.gather(
            *(self.call(n, "fleet_stage", args, stage_t) for n in names)
        )
        t_staged = time.perf_counter()
        for n, (code, msg, res) in zip(names, staged, strict=True):
            o = outcomes[n]
            o.previous_version = str(res.get("previous_version", ""))
            if code != 200:
                o.error_code, o.error_message, o.phase = code, msg, "stage"
        decision = "abort"
        if all(code == 200 for code, _, _ in staged):
            if self.test_commit_delay_s:  # test only: a window to kill the coordinator in
                log.warning("fleet %s: test delay before commit", txn)
                print(f"fleet {txn}: staged; test delay before commit", flush=True)
                await asyncio.sleep(self.test_commit_delay_s)
            decision = await self._decide(txn, "commit", "all staged")
        else:
            decision = await self._decide(txn, "abort", "stage failed")
        commit_s = 0.0
        if decision == "commit":
            t1 = time.perf_counter()
            commits = await asyncio.gather(
                *(self.call(n, "fleet_commit", TxnArgs(txn), self.ct + 5.0) for n in names)
            )
            commit_s = time.perf_counter() - t1
            bad = False
            for n, (code, msg, _) in zip(names, commits, strict=True):
                if code != 200:
                    bad = True
                    o = outcomes[n]
                    o.error_code, o.error_message, o.phase = code, msg, "commit"
            # a failed commit asks for abort; the record may already say ``done`` (an
            # instance's own timeout finished it), then that is the outcome
            decision = await self._decide(
                txn, "abort" if bad else "done", "commit failed" if bad else "all committed"
            )
        method = "fleet_finalize" if decision == "done" else "fleet_abort"
        ends = await asyncio.gather(
            *(self.call(n, method, TxnArgs(txn), self.ct + 5.0) for n in names)
        )
        for n, (code, msg, res) in zip(names, ends, strict=True):
            o = outcomes[n]
            o.version = str(res.get("weight_version", ""))
            if code == 200 and not o.previous_version:  # its stage failed: it never moved
                o.previous_version = o.version
            if o.phase == "stage" and o.error_code == CONFLICT:
                # busy (e.g. in another transaction): never in this one, and its version
                # now is not this transaction's doing
                o.outcome, o.previous_version, o.version = "not_started", "", ""
                continue
            if code != 200:
                o.outcome = "unknown"
                if o.error_code == 200:
                    o.error_code, o.error_message, o.phase = code, msg, method[6:]
                continue
            if o.version == version and decision == "done":
                o.outcome = "switched"
                if o.phase == "commit":  # e.g. its commit raced its own timeout: it is done
                    o.error_code, o.error_message, o.phase = 200, "", ""
            elif o.phase == "stage":
                o.outcome = "failed"
            elif res.get("rolled_back") or o.phase == "commit":
                o.outcome = "rolled_back"
            else:
                o.outcome = "stayed"
        out = list(outcomes.values())
        mark_unreachable(out, silent)
        code, msg = overall(out, decision, version)
        log.info("fleet %s: %s (%d) in %.2fs", txn, decision, code, time.perf_counter() - t0)
        return FleetResult(
            txn, version, decision, code, msg, out, time.perf_counter() - t0,
            t_staged - t0, commit_s,
        )

    async def _decide(self, txn: str, to: str, why: str) -> str:
        """CAS the decision; the record's decision afterwards (``abort`` if it cannot be
        read: no commit is sent without a written ``commit``)."""
        for attempt in range(10):
            try:
                rec = await self.bucket.decide(txn, to, "coordinator", f"{self.name}: {why}")
                return rec.decision if rec is not None else "abort"
            except Exception as e:  # noqa: BLE001 - NATS hiccup: retry a few times
                log.warning("fleet %s: cannot write %s (%r), retrying", txn, to, e)
                await asyncio.sleep(0.2 * (attempt + 1))
        return "abort" if to in ("commit", "abort") else to
