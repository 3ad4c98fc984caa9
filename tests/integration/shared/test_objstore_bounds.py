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


@pytest.mark.parametrize(
    "meta",
    [b"\x00not json", b"[1, 2]", b'{"nuid": "x", "size": "big"}'],
    ids=["not-json", "not-an-object", "bad-size"],
)
async def test_a_corrupt_meta_message_is_a_corrupt_object(nc: Client, meta: bytes) -> None:
    # a damaged replica (or a raw client) can leave any bytes as an object's meta: the
    # reader says corrupt (a rank: 422, not retried), never an unexpected ValueError (500)
    name = f"m/{uuid.uuid4().hex}/manifest.json"
    await objstore.put_object(nc, BUCKET, name, b"{}")
    await nc.jetstream().publish(
        objstore._meta_subject(BUCKET, name), meta, headers={"Nats-Rollup": "sub"}
    )
    with pytest.raises(objstore.ObjectCorrupt, match="meta"):
        await objstore.read_object(nc, BUCKET, name)
