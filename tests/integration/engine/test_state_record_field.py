"""A hand-edited field in the engine's stored state (real nats-server KV) loses only
itself: the engine's load gets the rest of the record back and says which field it
dropped, once. Before, the whole record was refused and the engine started from the
ranks' state (its version, pause and refused versions lost)."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import nats
import pytest

from services.engine import persist
from shared.statekv import StateBucket


async def test_load_keeps_the_record_but_a_corrupt_refused_field(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await nats.connect(nats_url)
    try:
        instance = f"hand-{uuid.uuid4().hex[:6]}"
        stored = {"state": "paused", "weight_version": "step-9", "pause_mode": "keep"}
        await StateBucket(nc, instance).put(json.dumps({**stored, "refused": "step-3"}).encode())
        eng = SimpleNamespace(
            bus=SimpleNamespace(nc=nc), settings=SimpleNamespace(instance=instance)
        )
        rec = await persist.Persister(eng).load()  # type: ignore[arg-type]
    finally:
        await nc.close()
    assert rec is not None, caplog.text
    assert (rec.state, rec.weight_version, rec.pause_mode, rec.refused) == (
        "paused",
        "step-9",
        "keep",
        [],
    )
    said = [r.getMessage() for r in caplog.records if r.name == "rollbus.engine.persist"]
    assert len(said) == 1 and "'refused'" in said[0], said
