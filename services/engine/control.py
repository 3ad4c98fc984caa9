"""One small function per control method (``rollbus.<i>.ctl.<method>``).

Each takes the engine and its decoded arguments and returns the reply's ``result`` or
raises ``ControlError``. Mutating methods run under the engine's control lock: a
second one arriving meanwhile gets 409 at once instead of queueing behind it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from services.engine.ranks import RankError
from services.engine.state import State
from shared import messages as m
from shared.bus import new_request_id
from shared.errors import NOT_FOUND, ControlError
from shared.model_config import CONFIG_FILE, read_hf_config
from shared.versions import check_version_arg, read_version_txt

if TYPE_CHECKING:
    from services.engine.main import Engine

log = logging.getLogger("rollbus.engine")


async def pause(eng: Engine, args: m.PauseArgs) -> dict[str, Any]:
    """Idempotent. Pausing an already paused engine with ``abort`` still ends every live
    request (kept or queued meanwhile): abort means "nothing is left running".

    ``wait`` drains while the state still says running; the state turns paused only
    once no step runs (a drain that times out leaves it running: 503)."""
    if args.mode == "wait" and eng.state.state is State.RUNNING:
        await eng.scheduler.pause("wait")
    changed = eng.state.pause(args.mode)
    aborted = 0
    if (changed and args.mode != "wait") or args.mode == "abort":
        aborted = await eng.scheduler.pause(args.mode)
    if changed:
        await eng.state_changed("paused", {"mode": args.mode, "aborted": aborted})
    return {"is_paused": True, "mode": eng.state.pause_mode or args.mode, "aborted": aborted}


async def resume(eng: Engine, _: m.NoArgs) -> dict[str, Any]:
    if eng.state.resume():
        async with eng.scheduler.quiet():
            eng.scheduler.resume()
        await eng.state_changed("running", {})
    return {"is_paused": eng.state.is_paused}


def is_paused(eng: Engine, _: object = None) -> dict[str, Any]:
    return {"is_paused": eng.state.is_paused}


async def sleep(eng: Engine, args: m.TagArgs) -> dict[str, Any]:
    tags = args.tag_set()
    aborted = 0
    if eng.state.state is State.RUNNING:
        eng.state.pause("abort")
        aborted = await eng.scheduler.pause("abort")
    eng.state.sleep(tags)  # recorded first: a half-failed sleep must not look awake
    await eng.state_changed("sleeping", {"tags": list(tags)})
    try:
        async with eng.scheduler.quiet():
            if "kv_cache" in tags:
                eng.scheduler.drop_kv()
            replies = await eng.ranks.call(
                "sleep",
                m.SleepWorkerArgs(list(tags), eng.settings.shutdown_comm_group_if_worker_idle),
            )
    finally:
        await eng.ranks.refresh()  # `status` right after shows what the ranks freed
    return {
        "is_paused": True,
        "tags": list(tags),
        "aborted": aborted,
        "ranks": [replies[r].result for r in sorted(replies)],
    }


async def wakeup(eng: Engine, args: m.TagArgs) -> dict[str, Any]:
    tags = args.tag_set()
    eng.state.check_wakeup(tags, eng.settings.use_cudagraph)
    t0 = time.perf_counter()
    async with eng.scheduler.quiet():
        try:
            replies = await eng.ranks.call(
                "wakeup",
                m.WakeupWorkerArgs(
                    list(tags), eng.state.weight_version, eng.settings.load_strategy
                ),
            )
        except RankError as e:
            # the engine stays asleep, so every rank does: those that woke free the tags
            # again (the memory the operator freed stays free; a rank that does not
            # answer gets it after its late wakeup, in order)
            back = [t for t in tags if t in eng.state.asleep]
            if back:
                args = m.SleepWorkerArgs(back, eng.settings.shutdown_comm_group_if_worker_idle)
                await settle(eng, "sleep", args)
            await eng.ranks.refresh()
            if e.code != NOT_FOUND:
                raise
            raise RankError(
                e.code,
                f"{e.message}; the current version {eng.state.weight_version!r} is gone: "
                "update_weights to another version (accepted while asleep), then wake up",
                e.replies,
            ) from None
        await eng.ranks.refresh()  # before the first step: `status` shows them awake
        resumed = eng.state.woke(tags)
        if resumed:
            eng.scheduler.resume()
    if resumed:
        await eng.state_changed("running", {"woke": list(tags)})
    return {
        "is_paused": eng.state.is_paused,
        "tags": list(tags),
        "still_asleep": sorted(eng.state.asleep),
        "weight_version": eng.state.weight_version,
        "seconds": time.perf_counter() - t0,
        "ranks": [replies[r].result for r in sorted(replies)],
    }


def default_version(eng: Engine) -> str:
    """``<model>/version.txt``, else the newest published version, else 404."""
    if (v := read_version_txt(eng.settings.model_dir)) is not None:
        return v
    if eng.latest_published:
        return eng.latest_published
    raise ControlError(NOT_FOUND, "no version given, no version.txt and nothing published")


async def update_weights(eng: Engine, args: m.UpdateWeightsArgs, actor: str = "") -> dict[str, Any]:
    async with eng.scheduler.quiet():  # no step in flight while ranks change weights
        return await _update_weights(eng, args, actor)


async def _update_weights(eng: Engine, args: m.UpdateWeightsArgs, actor: str) -> dict[str, Any]:
    """Paused or sleeping. A rank whose weights sleep validates the version (loads it to
    host memory, checks it, frees it) and records it as current: wakeup loads it."""
    eng.state.check_update()  # the 409 comes before anything else is looked at
    if args.version is not None:
        check_version_arg(args.version)  # over NATS too: a path component for the ranks
    version = args.version or default_version(eng)
    uid, previous = await begin_update(eng, version)
    t0 = time.perf_counter()
    committed: str | None = None
    try:
        staged = await stage_ranks(eng, version, args.verify_checksum, uid)
        t_staged = time.perf_counter()
        await commit_ranks(eng, version, uid, previous)
        committed = version
        await eng.ranks.broadcast("finalize", m.UpdateIdArgs(uid))
    finally:
        await end_update(eng, committed)
    await switched(eng, version, previous, actor)
    ranks = [staged[r].result for r in sorted(staged)]
    return {
        "version": version,
        "previous_version": previous,
        "bytes": sum(int(r.get("bytes", 0)) for r in ranks),
        "stage_s": t_staged - t0,
        "commit_s": time.perf_counter() - t_staged,
        "seconds": time.perf_counter() - t0,
        "ranks": ranks,
    }


# The steps of an update, shared by ``update_weights`` (all in one call) and the fleet
# transaction (``services.engine.fleet``: one control call per step). The caller holds
# the control lock and the step lock (``eng.scheduler.quiet()``).


async def begin_update(
    eng: Engine, version: str, extra: dict[str, Any] | None = None
) -> tuple[str, str]:
    """State ``updating``, persisted with a new update id before any rank is touched (a
    restarted engine rolls it back by id). Returns (update id, previous version)."""
    eng.state.begin_update()
    previous = eng.state.weight_version
    uid = new_request_id()
    await eng.state_changed(
        "updating", {"version": version, "from": previous, "update_id": uid, **(extra or {})}
    )
    return uid, previous


async def stage_ranks(
    eng: Engine, version: str, verify: bool | None, uid: str
) -> dict[int, m.WorkerReply]:
    try:
        return await eng.ranks.call(
            "stage", m.StageArgs(version, verify, eng.settings.load_strategy, uid)
        )
    except RankError:
        # no rank got a commit; those that staged drop it now (a rank that misses this
        # drops it at its next stage anyway)
        await settle(eng, "abort")
        raise


async def commit_ranks(eng: Engine, version: str, uid: str, previous: str) -> None:
    try:
        await eng.ranks.call("commit", m.CommitArgs(version, uid))
    except RankError as e:
        # some ranks may have switched: every one of them swaps back, and a late
        # commit for this update is refused, so no rank serves the new version alone
        log.warning("update to %r failed: %s; rolling the ranks back", version, e.message)
        await settle(eng, "rollback", m.UpdateIdArgs(uid))
        raise RankError(
            e.code,
            f"{e.message}; ranks that had committed were rolled back to {previous!r}",
            e.replies,
        ) from None


SETTLE_S = 2.0  # how long a failed update waits for the ranks' abort / rollback answers


async def settle(eng: Engine, method: str, args: msgspec.Struct | None = None) -> None:
    """``abort`` / ``rollback`` after a failed step (``sleep`` after a failed wakeup):
    every rank asked, their answers awaited (up to ``SETTLE_S``) so the view's refresh
    that ends the update sees them rolled back. Never raises: the step's own error is
    the one reported; a rank that does not answer is logged (it still gets the message,
    and a late commit for this update is refused)."""
    try:
        await eng.ranks.call(method, args, timeout=SETTLE_S)
    except Exception as e:  # noqa: BLE001 - the failed step's error is the one raised
        log.warning("%s after a failed step: %s", method, getattr(e, "message", repr(e)))


async def end_update(eng: Engine, committed: str | None) -> None:
    """Back to paused (or sleeping); ``committed`` is the new version, None if none.
    The ranks' view is refreshed first: a ``status`` after the update shows its outcome
    on every rank. Refreshed before the state ends: ``status`` meanwhile says
    ``updating``, never the new version over ranks still reported on the old one."""
    await eng.ranks.refresh()
    eng.state.end_update(committed)
    await eng.state_changed(eng.state.state.value, {"version": eng.state.weight_version})


async def switched(eng: Engine, version: str, previous: str, actor: str) -> None:
    """After a committed update: requests kept across it are recomputed; audit event."""
    eng.scheduler.weights_changed(version)
    await eng.event("version", {"version": version, "previous": previous, "actor": actor})


async def status(eng: Engine, args: m.StatusArgs | None = None) -> dict[str, Any]:
    """One hop: the ranks as the engine's view has them (``services.engine.ranks.RankView``:
    each rank's last report, ``age_ms``, not alive once silent past its bound), or, with
    ``fresh``, as every rank answers now."""
    if args is not None and args.fresh:
        seen = await eng.ranks.statuses(timeout=min(2.0, eng.settings.control_timeout_s))
    else:
        seen = eng.ranks.view.entries()
    ranks = [_brought(eng, r) for r in seen]
    ours = eng.state.weight_version
    return {
        "version_mismatch": sorted(
            r["rank"] for r in ranks if r.get("alive") and r.get("version", ours) != ours
        )
        if eng.state.state not in (State.UPDATING, State.SLEEPING)
        else [],
        "problems": eng.problems(seen),  # the same look at the ranks as `ranks`
        "tasks": eng.supervisor.report(),
        "state": eng.state.state.value,
        "is_paused": eng.state.is_paused,
        "weight_version": eng.state.weight_version,
        **eng.fixed_status,  # model, instance, tp, load_strategy, nats_url, pids
        "fleet": eng.fleet.describe(),  # the fleet transaction in progress, if any
        "asleep": sorted(eng.state.asleep),
        "pause_mode": eng.state.pause_mode,
        "ranks": ranks,
        # every rank alive and the engine's own check (ranks brought to its state)
        "ranks_ready": all(r.get("alive") for r in ranks) and eng.ranks_alive,
        # requests waiting for replies (0 when idle), replies and requests dropped
        "bus": eng.bus.counts(),
        # versions behind the newest announced, the bound, requests it holds
        "staleness": eng.scheduler.staleness_report().to_dict(),
        # the announced version auto-update waits for the files of (no pause), or None:
        # why the engine is not on the newest although running
        "auto_update_waiting": eng.auto_update_waiting,
        # why auto-update cannot follow its feed (refused, no JetStream), or None: the
        # engine stays on its version while the loop backs off with a single warning
        "auto_update_error": eng.auto_update_error,
        **eng.scheduler.counts(),
    }


def _brought(eng: Engine, entry: dict[str, Any]) -> dict[str, Any]:
    """A rank process the engine has not brought to its state (the launcher restarted
    it: not the pid the engine last reconciled) is not alive for ``status``: it may
    serve another version, or hold weights the engine says are asleep."""
    want = eng.rank_pids.get(int(entry["rank"]))
    pid = entry.get("pid")
    if not entry.get("alive") or not want or pid is None or int(pid) == want:
        return entry
    reason = f"restarted (pid {pid}): not yet brought to the engine's state"
    return {**entry, "alive": False, "reason": reason}


def model_config(eng: Engine, _: object = None) -> dict[str, Any]:
    """The served model's HF ``config.json``: what a trainer shards a state dict by."""
    cfg = HF_CONFIGS.read(eng.settings.model_dir)
    return {"model": eng.fixed_status["model"], "tp": eng.settings.tp, "config": cfg}


class HFConfigs:
    """:func:`read_hf_config` of a model dir, read again only when the file changed: its
    ``os.stat`` (inode, size, mtime in ns) is taken on every call and compared with the
    one of the copy held (one stat, not open + read + JSON parse per ``model_config``)."""

    def __init__(self) -> None:
        self.held: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}

    def read(self, model_dir: Path) -> dict[str, Any]:
        path = Path(model_dir) / CONFIG_FILE
        try:
            st = os.stat(path)
        except OSError:
            return read_hf_config(model_dir)  # its error names what is wrong
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        held = self.held.get(path)
        if held is not None and held[0] == key:
            return held[1]
        cfg = read_hf_config(path)
        self.held = {path: (key, cfg)}  # one model dir per engine
        return cfg


HF_CONFIGS = HFConfigs()


def health(eng: Engine, _: object = None) -> dict[str, Any]:
    """``problems`` empty = healthy; ``tasks`` carries the supervisor's failure counts
    and ``callback_errors`` the bus's, for ``/metrics``."""
    return {
        "problems": eng.problems(),
        "version_mismatch": sorted(eng.version_mismatch),
        "tasks": eng.supervisor.report(),
        "callback_errors": dict(eng.bus.callback_errors),
        # pids: /metrics tells a restarted process's counts (from 0) from a live one's
        "pid": os.getpid(),
        "ranks_health": {
            str(r): {
                **{k: p.get(k, {}) for k in ("callback_errors", "task_failures")},
                "pid": p.get("pid", 0),
            }
            for r, p in eng.rank_pings.items()
        },
        "ready": eng.ready,
        "ranks_alive": eng.ranks_alive,
        "state": eng.state.state.value,
        "weight_version": eng.state.weight_version,
        "model": eng.fixed_status["model"],
        "max_model_len": eng.max_model_len,
        "staleness": eng.scheduler.staleness_report().to_dict(),
    }
