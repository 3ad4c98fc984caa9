"""Which reply subjects the engine probes to find requests nobody reads (their API died):
one per inbox prefix for the API's batched requests, one per reply for the others."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import pytest

from services.engine import orphans
from services.engine.orphans import probe_targets
from services.engine.scheduler import Request
from shared import messages as m


def req(rid: str, reply: str, batch: bool) -> Request:
    return Request(m.GenRequest(rid, [1], max_tokens=4, batch=batch), reply)


def test_one_probe_per_api_inbox_and_per_raw_reply() -> None:
    reqs = [
        req("a1", "_INBOX_api.A.t1", True),
        req("b1", "_INBOX_api.B.t1", True),
        req("a2", "_INBOX_api.A.t2", True),
        # raw clients, one subscription per request: each probed on its own reply
        req("r1", "_INBOX.x.t1", False),
        req("r2", "_INBOX.x.t2", False),
    ]
    assert probe_targets(reqs) == [
        ("_INBOX_api.A.t1", ["a1", "a2"]),  # the probe carries a1's id: its own reply
        ("_INBOX_api.B.t1", ["b1"]),
        ("_INBOX.x.t1", ["r1"]),
        ("_INBOX.x.t2", ["r2"]),
    ]


class Gone(Exception):
    """Ends a probe loop at its first cancel."""


class Host:
    """A fake clock and the readers of some reply subjects: ``unread`` answers from who
    reads at the round's start and, as the real one, takes ``PROBE_TIMEOUT_S`` when any
    probed subject has a reader (its probe waits for a reply that never comes)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.t = 0.0
        self.read: set[str] = set()
        self.during_round: Callable[[], None] = lambda: None
        real_sleep = asyncio.sleep

        async def sleep(s: float) -> None:
            self.t += max(s, 0.0)
            await real_sleep(0)

        async def unread(
            bus: object, reqs: Iterable[Request], *a: object, **k: object
        ) -> list[str]:
            reqs = list(reqs)
            gone = [r.request_id for r in reqs if r.reply not in self.read]
            self.during_round()  # just after the probes went out
            if len(gone) < len(reqs):
                self.t += orphans.PROBE_TIMEOUT_S
            return gone

        monkeypatch.setattr(orphans.asyncio, "sleep", sleep)
        # raising=False: a loop that reads no clock sleeps PROBE_S flat
        monkeypatch.setattr(
            orphans, "time", SimpleNamespace(monotonic=lambda: self.t), raising=False
        )
        monkeypatch.setattr(orphans, "unread", unread)


def test_a_gone_reader_is_cancelled_within_the_stated_bound_beside_a_live_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # README "Recovery" row api: 2 x PROBE_S + PROBE_TIMEOUT_S. Every round waits
    # PROBE_TIMEOUT_S for the live reader; sleeping PROBE_S after each made it 7 s (red)
    host = Host(monkeypatch)
    host.read = {"_INBOX.a", "_INBOX.b"}
    reqs = [req("a", "_INBOX.a", False), req("b", "_INBOX.b", False)]
    left: list[float] = []

    def leave_after_first_round() -> None:
        if not left:
            host.read.discard("_INBOX.a")  # just after its probe found it read
            left.append(host.t)

    host.during_round = leave_after_first_round

    def cancel(rid: str) -> None:
        assert rid == "a"
        raise Gone(host.t - left[0])

    with pytest.raises(Gone) as e:
        asyncio.run(orphans.probe_loop(None, lambda: reqs, lambda r, i: b"", cancel))  # type: ignore[arg-type]
    took = e.value.args[0]
    assert took <= 2 * orphans.PROBE_S + orphans.PROBE_TIMEOUT_S, took


def test_a_reused_request_id_starts_its_own_streak(monkeypatch: pytest.MonkeyPatch) -> None:
    # "a" got no-responders, ended; a client's new request "a" (ids are refused only while
    # running) meets one no-responders on its new inbox (a gateway's late interest):
    # that is its first, not the second of the old one's
    host = Host(monkeypatch)
    rounds = orphans.Rounds(None, lambda r, i: b"")  # type: ignore[arg-type]
    assert asyncio.run(rounds.round([req("a", "_INBOX.old", False)])) == []
    assert asyncio.run(rounds.round([req("a", "_INBOX.new", False)])) == []
    assert asyncio.run(rounds.round([req("a", "_INBOX.new", False)])) == ["a"]
    assert host.t == 0.0


def test_a_request_that_ended_during_the_round_takes_no_successor_along(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the confirming round waits for the live readers; meanwhile the gone reader's request
    # ended and a new one reused its id: cancel(id) would end the new one
    host = Host(monkeypatch)
    host.read = {"_INBOX.b"}
    live = {"a": req("a", "_INBOX.a", False), "b": req("b", "_INBOX.b", False)}
    rounds_seen: list[int] = []

    def replace_on_second_round() -> None:
        rounds_seen.append(1)
        if len(rounds_seen) == 2:
            live["a"] = req("a", "_INBOX.a2", False)
            host.read.add("_INBOX.a2")
        elif len(rounds_seen) == 4:
            raise Gone("no cancel in three rounds")

    host.during_round = replace_on_second_round
    cancelled: list[str] = []
    with pytest.raises(Gone):
        asyncio.run(
            orphans.probe_loop(None, live.values, lambda r, i: b"", cancelled.append)  # type: ignore[arg-type]
        )
    assert cancelled == []
