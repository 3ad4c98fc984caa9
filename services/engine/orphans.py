"""Requests nobody reads any more: their reply inbox has no subscriber.

A client that leaves cancels its request through its API (``gen.cancel``). An API process
that dies (SIGKILL, OOM) cannot: without this its requests ran on to ``max_tokens`` —
holding batch rows and KV blocks, preempting the next clients' requests — although no
token could reach anyone. Same for a raw NATS client that stopped listening (``nats req``
takes the first chunk and leaves).

Every :data:`PROBE_S` the engine sends one heartbeat chunk (what the reader gets anyway)
as a NATS *request* to each live request's reply subject. NATS answers a request that no
subscription matches with a no-responders status at once: that request is gone and is
cancelled as its client's cancel would. A subscriber that is there never replies to a
heartbeat, so the wait ends at :data:`PROBE_TIMEOUT_S` and means "still read". A lost
NATS connection of the API also removes its subscription — its requests were failed by
that API already (README "Recovery"), so cancelling them too is right.

One no-responders status is not proof: across a gateway, a new subscription's interest
(RS+) reaches the engine's server on another TCP connection than the messages that
follow it, so a probe can beat it (measured: 5 in 110 runs with 3 busy loops on 2
cores; forced in ``tests/integration/engine/test_reply_probe_topologies.py``). A
request is cancelled only when two consecutive rounds, at least :data:`PROBE_S` apart,
both got one: a reader that left is cancelled within ``2 * PROBE_S + PROBE_TIMEOUT_S``
(~5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from services.engine.scheduler import Request
from shared.bus import Bus
from shared.errors import NoResponders, NotConnected, Timeout

log = logging.getLogger("rollbus.engine.orphans")

PROBE_S = 2.0  # how often every live request's reply subject is probed
PROBE_TIMEOUT_S = 1.0  # a no-responders status comes within a round trip; else: read


def _batch_flag(req: Request) -> bool:
    return req.gen.batch


def probe_targets(
    requests: Iterable[Request], batched: Callable[[Request], bool] = _batch_flag
) -> list[tuple[str, list[str]]]:
    """(reply subject to probe, the request ids that end with it; the first is the
    request that subject belongs to). One probe per reply
    subject, and one per inbox prefix for ``batched`` requests (the API's): their chunks
    go to ``<prefix>.batch``, which only a wildcard subscription on the prefix receives,
    so one reply subject under it answers for all of them. Only those: a JSON client's
    ``batch`` is ignored (its chunks go to its own reply), and many raw clients share a
    prefix (nats-py's old-style inboxes ``_INBOX.<nuid>`` all have ``_INBOX``) — one of
    them gone must not cancel the others."""
    groups: dict[str, tuple[str, list[str]]] = {}
    for req in requests:
        key = req.reply.rpartition(".")[0] + ".*" if batched(req) else req.reply
        groups.setdefault(key, (req.reply, []))[1].append(req.request_id)
    return list(groups.values())


async def unread(
    bus: Bus,
    requests: Iterable[Request],
    encode: Callable[[str, str], bytes],
    timeout: float = PROBE_TIMEOUT_S,
    batched: Callable[[Request], bool] = _batch_flag,
) -> list[str]:
    """The ids of ``requests`` whose reply subject no subscription matches now.
    ``encode(reply, request_id)``: the heartbeat chunk sent as the probe; ``batched``:
    whether a request's chunks go to its inbox prefix's batch subject."""
    targets = probe_targets(requests, batched)

    async def gone(reply: str, rids: list[str]) -> bool:
        sent = await bus.send(reply, encode(reply, rids[0]), request_id=rids[0])
        try:
            await sent.reply(timeout)
        except NoResponders:
            return True
        except Timeout:
            pass  # a reader is there (it never answers a heartbeat)
        return False

    found = await asyncio.gather(*(gone(r, ids) for r, ids in targets))
    return [rid for (_, ids), g in zip(targets, found, strict=True) if g for rid in ids]


class Rounds:
    """Probe rounds that remember the previous one: :meth:`round` returns the ids to
    cancel — found gone now *and* in the round before (the module doc)."""

    def __init__(
        self,
        bus: Bus,
        encode: Callable[[str, str], bytes],
        batched: Callable[[Request], bool] = _batch_flag,
        timeout: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.bus, self.encode, self.batched, self.timeout = bus, encode, batched, timeout
        # (request id, reply subject) that got no-responders in the last round: an id a
        # client reuses once its request ended (only running ids are refused) comes with
        # another reply subject, and its first no-responders is its first
        self.suspected: set[tuple[str, str]] = set()

    async def round(self, requests: Iterable[Request]) -> list[str]:
        live = list(requests)
        if not live:
            self.suspected.clear()
            return []
        try:
            now = await unread(self.bus, live, self.encode, self.timeout, self.batched)
        except NotConnected:
            self.suspected.clear()  # a round that could not probe breaks every streak
            raise
        reply = {r.request_id: r.reply for r in live}
        keys = [(rid, reply[rid]) for rid in now]
        confirmed = [rid for rid, key in zip(now, keys, strict=True) if key in self.suspected]
        self.suspected = set(keys)
        return confirmed


async def probe_loop(
    bus: Bus,
    requests: Callable[[], Iterable[Request]],
    encode: Callable[[str, str], bytes],
    cancel: Callable[[str], None],
    batched: Callable[[Request], bool] = _batch_flag,
) -> None:
    """Forever, every :data:`PROBE_S`: cancel every request whose reply subject had no
    subscriber in two rounds in a row (the module doc). Run under the engine's
    supervisor (task ``reply_probe``)."""
    rounds = Rounds(bus, encode, batched)
    start = time.monotonic()
    while True:
        # rounds start every PROBE_S, not PROBE_S after the last one ended: a round waits
        # PROBE_TIMEOUT_S for every live reader, and two such waits in the gap would
        # make the bound 2 * (PROBE_S + PROBE_TIMEOUT_S) + PROBE_TIMEOUT_S
        start = max(start + PROBE_S, time.monotonic())
        await asyncio.sleep(start - time.monotonic())
        with contextlib.suppress(NotConnected):  # NATS away: the next round
            live = list(requests())
            gone = await rounds.round(live)
            # one that ended while the round waited may have been followed by a request
            # reusing its id: only the one probed is cancelled
            probed = {r.request_id: r.reply for r in live}
            now = {r.request_id: r.reply for r in requests()}
            gone = [rid for rid in gone if now.get(rid) == probed[rid]]
            if gone:
                log.warning(
                    "cancelled %d request(s) nobody reads (reply inbox gone twice in a row: "
                    "its API or client left): %s",
                    len(gone),
                    ", ".join(gone[:5]) + (" …" if len(gone) > 5 else ""),
                )
            for rid in gone:
                cancel(rid)
