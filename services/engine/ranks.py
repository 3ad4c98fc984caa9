"""Fan-out from the engine to every worker rank (``rollbus.<i>.worker.ctl.<method>``),
and the engine's view of the ranks: what each rank last said on ``status``, and when."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from shared import messages as m
from shared import procs
from shared.bus import Bus, Reply
from shared.errors import LOST, UNAVAILABLE, ControlError, Timeout
from shared.subjects import Subjects

log = logging.getLogger("rollbus.engine")


# worker.ctl calls that change a rank: when one of them finds a rank silent, that rank may
# still apply it later, or miss what the engine sent to undo it (its NATS connection
# dropped while it was stopped: the server drops what it had for it), so the engine
# brings every rank back to its own state once they all answer again (``unsettled``)
CHANGES = frozenset({"stage", "commit", "abort", "rollback", "finalize", "sleep", "wakeup"})


class RankError(ControlError):
    """Some ranks failed or did not answer; ``replies`` holds the ones that did."""

    def __init__(self, code: int, message: str, replies: dict[int, m.WorkerReply]) -> None:
        super().__init__(code, message)
        self.replies = replies


def _exited(report: dict[str, Any]) -> bool:
    """The reporting rank's process has exited (only known when it shares our pid
    space: same host boot and pid namespace, as ranks ``rollbus serve`` starts)."""
    space, pid = report.get("pid_space"), report.get("pid")
    if not space or space != procs.pid_space() or not isinstance(pid, int):
        return False
    return procs.gone(pid)


class RankView:
    """Every rank's last ``status`` report (as the rank sent it: pid, version, weights,
    KV, compute-thread ``busy``/``busy_s``, …) with the monotonic time it arrived.

    Fed by every status scatter (the engine's watcher every ``refresh_s``, and one at
    the end of every operation that changes the ranks). Reports are ordered by the
    round that asked for them: a late answer to an older round never replaces a newer
    one. A rank is shown alive only while its report is fresh (younger than
    ``stale_s`` = max(3 × ``refresh_s``, 1 s)) and it answered its last round."""

    def __init__(self, tp: int, refresh_s: float) -> None:
        self.tp, self.refresh_s = tp, refresh_s
        self.stale_s = max(3 * refresh_s, 1.0)
        self.rounds = 0
        self.reports: dict[int, dict[str, Any]] = {}
        self.at: dict[int, float] = {}  # rank -> monotonic time its report arrived
        self.round_of: dict[int, int] = {}  # rank -> the round its report answered
        self.missed: dict[int, tuple[int, str]] = {}  # rank -> (round, why) unanswered

    def begin(self) -> int:
        self.rounds += 1
        return self.rounds

    def record(self, rnd: int, rank: int, report: dict[str, Any], at: float) -> None:
        if rnd < self.round_of.get(rank, 0):
            return  # an older round answered after a newer one
        self.reports[rank], self.at[rank], self.round_of[rank] = report, at, rnd
        if self.missed.get(rank, (0, ""))[0] <= rnd:
            self.missed.pop(rank, None)

    def miss(self, rnd: int, rank: int, why: str) -> None:
        if rnd > self.round_of.get(rank, 0) and rnd >= self.missed.get(rank, (0, ""))[0]:
            self.missed[rank] = (rnd, why)

    def entry(self, rank: int, now: float) -> dict[str, Any]:
        """The rank as ``status`` shows it: its report, ``alive``, ``age_ms`` (time since
        the report arrived) and, when not alive, ``reason``."""
        rep = self.reports.get(rank)
        missed = self.missed.get(rank)
        if rep is None:
            why = f"no report yet ({missed[1]})" if missed else "no report yet"
            return {"rank": rank, "alive": False, "age_ms": None, "reason": why}
        age = now - self.at[rank]
        out = {**rep, "rank": rank, "alive": True, "age_ms": round(age * 1e3, 1)}
        if _exited(rep):
            # killed: seen at once, not after the bound; said first, whatever the age
            # of its last report (the exit is the fact, the silence only follows it)
            out["alive"] = False
            out["reason"] = f"its process {rep.get('pid')} has exited"
        elif missed is not None:
            out["alive"] = False
            out["reason"] = f"no report for {age:.1f} s ({missed[1]})"
        elif age > self.stale_s:
            out["alive"] = False
            out["reason"] = f"no report for {age:.1f} s (status asked every {self.refresh_s:g} s)"
        return out

    def entries(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [self.entry(r, now) for r in range(self.tp)]

    def gone(self, pids: dict[int, int]) -> list[int]:
        """Ranks whose process of ``pids`` (rank -> pid) is known to be gone: it has
        exited (seen from here), or the rank's last report names another pid (it was
        restarted). A silent or stopped rank is not gone: it may still answer."""
        out = []
        for rank, pid in sorted(pids.items()):
            rep = self.reports.get(rank)
            if pid and rep is not None and (rep.get("pid") != pid or _exited(rep)):
                out.append(rank)
        return out


class Ranks:
    def __init__(
        self, bus: Bus, subjects: Subjects, tp: int, timeout: float, refresh_s: float = 0.25
    ) -> None:
        self.bus, self.subjects, self.tp, self.timeout = bus, subjects, tp, timeout
        self.view = RankView(tp, refresh_s)
        # the last call of CHANGES some rank did not answer ("" = none since the ranks
        # were last brought to the engine's state), and how many such calls so far
        self.unsettled = ""
        self.unsettled_n = 0

    async def call(
        self,
        method: str,
        args: msgspec.Struct | None = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> dict[int, m.WorkerReply]:
        """Scatter ``method`` to all ranks; every rank must answer and succeed.

        Raises :class:`RankError`: 503 naming ranks that did not answer, else the first
        failing rank's code with every failing rank's message.
        """
        t = timeout or self.timeout
        raw, missing, lost = await self._scatter(method, args, t, request_id)
        if missing and method in CHANGES:
            self.unsettled = f"{method}: ranks {missing} did not answer"
            self.unsettled_n += 1
        return self._check(method, t, raw, missing, lost)

    def settled(self, seen: int) -> None:
        """The ranks were brought to the engine's state after call ``seen`` of
        ``unsettled_n``: clear ``unsettled`` unless another call failed meanwhile."""
        if self.unsettled_n == seen:
            self.unsettled = ""

    async def _scatter(
        self,
        method: str,
        args: msgspec.Struct | None,
        t: float,
        request_id: str | None = None,
        on_reply: Callable[[int, Reply], None] | None = None,
    ) -> tuple[dict[int, Reply], list[int], bool]:
        """Raw replies by rank (undecoded), the silent ranks, and whether the wait was cut
        short by a lost NATS connection."""
        data = m.json_encode(args) if args is not None else b"{}"
        try:
            raw = await self.bus.scatter(
                self.subjects.worker_ctl(method),
                data,
                expected=self.tp,
                timeout=t,
                request_id=request_id,
                on_reply=on_reply,
            )
            return raw, [], False
        except Timeout as e:
            return (e.result or {}).get("replies", {}), e.missing, e.lost

    def _check(
        self,
        method: str,
        t: float,
        raw: dict[int, Reply],
        missing: list[int],
        lost: bool = False,
        decoded: dict[int, m.WorkerReply] | None = None,
    ) -> dict[int, m.WorkerReply]:
        """``decoded``: replies of ``raw`` already decoded as they arrived (not again)."""
        got = decoded or {}
        replies = {
            r: got.get(r) or m.json_decode(rep.data, type=m.WorkerReply) for r, rep in raw.items()
        }
        if missing:
            # cut short: the engine's NATS connection dropped meanwhile
            why = f"({LOST})" if lost else f"within {t:g}s"
            raise RankError(UNAVAILABLE, f"{method}: ranks {missing} did not answer {why}", replies)
        failed = sorted((r, rep) for r, rep in replies.items() if rep.error_code != 200)
        if failed:
            by_msg: dict[str, list[int]] = {}
            for r, rep in failed:
                text = rep.error_message.removeprefix(f"rank {r}: ")
                by_msg.setdefault(text, []).append(r)
            msg = "; ".join(
                f"rank {rs[0]}: {text}" if len(rs) == 1 else f"ranks {rs}: {text}"
                for text, rs in by_msg.items()
            )
            raise RankError(failed[0][1].error_code, f"{method} failed: {msg}", replies)
        return replies

    async def broadcast(self, method: str, args: msgspec.Struct | None = None) -> None:
        """Tell every rank without waiting for replies."""
        data = m.json_encode(args) if args is not None else b"{}"
        await self.bus.publish(self.subjects.worker_ctl(method), data)

    async def poll(self, timeout: float | None = None) -> dict[int, m.WorkerReply]:
        """Ask every rank's ``status`` now; each answer goes into :attr:`view` as it
        arrives (one silent rank does not hold back the others' reports), a rank silent
        for ``timeout`` is recorded as such. Raises :class:`RankError` as :meth:`call`
        does. ``timeout`` defaults to the view's staleness bound."""
        t = timeout or self.view.stale_s
        rnd = self.view.begin()
        view = self.view
        decoded: dict[int, m.WorkerReply] = {}

        def arrived(rank: int, reply: Reply) -> None:
            try:
                rep = decoded[rank] = m.json_decode(reply.data, type=m.WorkerReply)
            except msgspec.DecodeError as e:
                view.miss(rnd, rank, f"status reply does not decode: {e}")
                return
            if rep.error_code == 200:
                view.record(rnd, rank, rep.result, time.monotonic())
            else:
                view.miss(rnd, rank, f"status failed: {rep.error_message}")

        raw, missing, lost = await self._scatter("status", None, t, on_reply=arrived)
        for r in missing:
            view.miss(rnd, r, f"did not answer status within {t:g} s")
        return self._check("status", t, raw, missing, lost, decoded)

    async def refresh(self, timeout: float | None = None) -> None:
        """:meth:`poll`, never raising (it ends operations, also in their ``finally``):
        the view says which ranks did not answer; a bus that cannot send is logged."""
        try:
            await self.poll(timeout)
        except RankError:
            pass
        except Exception as e:  # noqa: BLE001 - e.g. NATS down: the view goes stale
            log.warning("could not ask the ranks' status: %r", e)

    async def statuses(self, timeout: float = 1.0) -> list[dict[str, Any]]:
        """Each rank's status asked now (:meth:`refresh`), as ``status`` shows it: a
        silent rank is ``alive: false`` with a reason."""
        await self.refresh(timeout)
        return self.view.entries()
