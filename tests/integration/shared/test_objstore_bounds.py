"""The reader refuses an object larger than the caller's bound before allocating it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from shared import objstore

BUCKET = "rollbus_test"
MIB = 1 << 20


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    c = await nats.connect(nats_url)
    await objstore.ensure_bucket(c, BUCKET)
    yield c
    await c.close()


async def test_max_size_refuses_a_larger_object_unread(nc: Client) -> None:
    name = f"m/{uuid.uuid4().hex}/manifest.json"
    await objstore.put_object(nc, BUCKET, name, b"x" * (3 * MIB))
    with pytest.raises(objstore.ObjectCorrupt, match="exceeds the limit"):
        await objstore.read_object(nc, BUCKET, name, max_size=2 * MIB)
    buf = await objstore.read_object(nc, BUCKET, name, max_size=3 * MIB)
    assert len(buf) == 3 * MIB
