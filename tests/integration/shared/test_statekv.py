"""The engine's state bucket against a real nats-server."""

from __future__ import annotations

import uuid

import nats

from shared.statekv import STATE_BUCKET, StateBucket


async def test_put_get_per_instance(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        a = StateBucket(nc, f"inst.{uuid.uuid4().hex[:6]} a")
        b = StateBucket(nc, f"other-{uuid.uuid4().hex[:6]}")
        assert await a.get() is None
        await a.put(b'{"state": "paused"}')
        await a.put(b'{"state": "sleeping"}')
        assert await a.get() == b'{"state": "sleeping"}'
        assert await b.get() is None
        kv = await nc.jetstream().key_value(STATE_BUCKET)
        assert (await kv.get(a.key)).value == b'{"state": "sleeping"}'
        assert a.key.startswith("inst=2E") and "=20a" in a.key  # '.' and ' ' escaped
    finally:
        await nc.close()
