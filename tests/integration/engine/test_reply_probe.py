"""The engine's reply probe (``orphans``, task ``reply_probe``) on a real nats-server:
it cancels a request whose reply inbox nobody subscribes to any more, and never one
whose reader is there — also when both came from raw JSON clients that set ``batch``
(ignored for JSON: their chunks go to their own reply, so their inbox prefix says
nothing about them; nats-py's old-style inboxes ``_INBOX.<nuid>`` all share one)."""

from __future__ import annotations

import asyncio

import pytest

from services.engine import orphans
from shared import messages as m
from shared.bus import Bus
from tests.unit.engine.test_step_lock import engine


async def test_a_gone_json_client_does_not_take_a_live_one_with_it(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bus = await Bus.connect(nats_url, "probe-test")
    client = await Bus.connect(nats_url, "raw-client")
    try:
        live = client.nc.new_inbox()  # "_INBOX.<nuid>": a raw client's own inbox
        gone = client.nc.new_inbox()  # its client left: nobody subscribes
        sub = await client.nc.subscribe(live)
        await client.nc.flush()
        eng = engine()
        eng.bus = bus
        g = eng.scheduler
        for rid, reply in (("gone", gone), ("live", live)):
            g._json_replies[reply] = 0.0  # came as JSON: batch is not honoured for it
            g.sched.add(m.GenRequest(rid, [1, 2], max_tokens=4, batch=True), reply)
        monkeypatch.setattr(orphans, "PROBE_S", 0.05)
        task = asyncio.ensure_future(g.probe_replies())
        try:
            # a round's cancels come after all its probes: the live one's ends at its
            # 1 s timeout ("read"), so the live request is decided once "gone" is in
            for _ in range(1200):
                if "gone" in g._cancels:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert "gone" in g._cancels
        assert "live" not in g._cancels, g._cancels
        await sub.unsubscribe()
    finally:
        await client.close()
        await bus.close()
