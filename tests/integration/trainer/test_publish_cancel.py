"""A publish cancelled at the worst moments leaks no shard ring: cancelled while a ring
is being taken (on a thread), or cancelled again while a failed shard waits for its fill
thread to end. Real publisher, real nats-server; the ring memory is real mappings."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import uuid
from typing import Any

import pytest

from services.tiny_model import TINY_CONFIG
from services.trainer import names, shards
from services.trainer.publisher import CheckpointPublisher, _Ring
from shared import sharding
from shared.model_config import ModelConfig

CFG = {**TINY_CONFIG, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}


def _state() -> dict[str, Any]:
    cfg = ModelConfig.from_hf(CFG)
    return names.to_training(sharding.init_weights(cfg, 3), cfg)


def _recording(pub: CheckpointPublisher, monkeypatch: pytest.MonkeyPatch,
               delay: float = 0.0) -> tuple[list[_Ring], threading.Event]:
    rings: list[_Ring] = []
    began = threading.Event()
    real = pub._rings.take

    def take(size: int, ring: int) -> _Ring:
        began.set()
        time.sleep(delay)
        rings.append(real(size, ring))
        return rings[-1]

    monkeypatch.setattr(pub._rings, "take", take)
    return rings, began


async def _until(cond: Any, wait: float = 10.0) -> None:
    deadline = time.monotonic() + wait
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _kept_or_closed(pub: CheckpointPublisher, r: _Ring) -> bool:
    return r in pub._rings.free or not r.mapped


async def test_cancel_while_a_ring_is_taken_keeps_the_ring(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = CheckpointPublisher(nats_url)
    rings, began = _recording(pub, monkeypatch, delay=0.5)
    t = asyncio.ensure_future(
        pub.apublish(f"cr-{uuid.uuid4().hex[:6]}", "v1", _state(), tp=1, config=CFG))
    await _until(began.is_set)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await _until(lambda: bool(rings))  # the take on its thread still ends
    await asyncio.sleep(0.1)
    assert len(rings) == 1 and rings[0] in pub._rings.free  # back in the cache


async def test_cancelled_twice_while_the_fill_ends_frees_the_ring(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = CheckpointPublisher(nats_url)
    rings, _ = _recording(pub, monkeypatch)
    filling = threading.Event()
    real_fill = shards.ShardLayout.fill

    def slow_fill(self: shards.ShardLayout, *a: Any, **kw: Any) -> None:
        filling.set()
        time.sleep(1.0)
        real_fill(self, *a, **kw)

    monkeypatch.setattr(shards.ShardLayout, "fill", slow_fill)
    t = asyncio.ensure_future(
        pub.apublish(f"cf-{uuid.uuid4().hex[:6]}", "v1", _state(), tp=1, config=CFG))
    await _until(filling.is_set)
    t.cancel()  # the shard's put ends; it then waits for its fill thread ...
    await asyncio.sleep(0.3)
    t.cancel()  # ... and is cancelled again while it waits
    with pytest.raises(asyncio.CancelledError):
        await t
    await asyncio.sleep(1.5)  # the fill thread has ended
    gc.collect()
    assert len(rings) == 1 and _kept_or_closed(pub, rings[0])


def _mapped(addr: int) -> bool:
    """Some mapping holds ``addr`` (the kernel may merge the ring's range with a neighbouring
    anonymous one, so the line need not start at it: a full-suite run failed so)."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            if start <= addr < end:
                return True
    return False


def test_ring_closed_after_a_failure_unmaps_once_unreferenced() -> None:
    """``close(False)`` (a failed publish) swaps the memory for zero pages at once, and
    releases the address range when the last slice of the ring is gone."""
    r = _Ring(3 << 20, 1 << 20)
    base = r.base
    view = memoryview(r.buf).cast("B")  # as a socket's pending write may hold a slice
    view[:3] = b"abc"
    r.close(False)
    assert _mapped(base) and bytes(view[:3]) == b"\0\0\0"  # zero pages: no crash, no data
    del view
    gc.collect()
    assert not _mapped(base)
