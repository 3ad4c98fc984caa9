"""The object reader's SHA-256 helper, pure: fed the filled length in any steps (bytes
landing a few KiB at a time, whole chunks, large jumps of a reader far ahead), it hashes
every byte once, in order, in place; what is left under a chunk is hashed at the end."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random

import pytest

from shared import objstore


@pytest.mark.parametrize("seed", range(4))
async def test_digest_of_every_byte_in_order(seed: int) -> None:
    rng = random.Random(seed)
    data = bytearray(os.urandom(7 * objstore.HASH_MIN + rng.randrange(1, 4096)))
    h = objstore._Hasher(memoryview(data))
    filled = 0
    while filled < len(data):
        filled = min(len(data), filled + rng.choice([1, 4096, 65536, objstore.HASH_MIN,
                                                     3 * objstore.HASH_MIN + 17]))
        h.feed(filled)
        if rng.random() < 0.2:
            await asyncio.sleep(0.001)  # let the helper catch up now and then
    h.feed(len(data), final=True)
    assert await h.hexdigest() == hashlib.sha256(data).hexdigest()
    assert h.hashed == len(data) and not h.running
    h.pool.shutdown()


async def test_less_than_a_chunk_is_hashed_at_the_end() -> None:
    data = os.urandom(objstore.HASH_MIN - 1)
    h = objstore._Hasher(memoryview(data))
    h.feed(len(data))
    await asyncio.sleep(0.01)
    assert h.hashed == 0  # waits for a chunk's worth (or the end)
    h.feed(len(data), final=True)
    assert await h.hexdigest() == hashlib.sha256(data).hexdigest()
    h.pool.shutdown()


async def test_a_failed_read_hashes_nothing_more() -> None:
    data = os.urandom(4 * objstore.HASH_MIN)
    h = objstore._Hasher(memoryview(data))
    h.dead = True
    h.feed(len(data), final=True)
    await asyncio.get_running_loop().run_in_executor(h.pool, lambda: None)
    assert h.hashed == 0 and not h.running
    h.pool.shutdown()
