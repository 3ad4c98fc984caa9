"""The auto-update's look for a version's files (:func:`services.engine.autoupdate.pending`)
says "refused (403)" when nats-server refuses the engine's look at the bucket, not "no
answer": real nats-server with ``infra/nats/auth.conf``, an engine whose
``ROLLBUS_CKPT_BUCKET`` is not the bucket that auth.conf grants it (generated for the
default one).

Without the fix the refusal was swallowed as "cannot be told" and reported as
``<name>: no answer``, which the assertion refuses."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.engine.autoupdate import _meanwhile, index_of, pending
from shared.bus import Bus
from tests import natsconf

BUCKET = "elsewhere"  # auth.conf grants the engine rollbus_ckpt's metas only


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Any]:
    """What :func:`pending` reads of an engine: its bus (the engine role's) and settings."""
    passwords = natsconf.role_passwords()
    node = natsconf.single_with_auth(tmp_path, passwords)
    node.start()
    bus = None
    try:
        url = f"nats://engine:{passwords['engine']}@127.0.0.1:{node.port}"
        bus = await Bus.connect(url, "test-engine")
        yield SimpleNamespace(
            bus=bus,
            state=SimpleNamespace(weight_version="v1"),
            settings=SimpleNamespace(
                served_model_name="m",
                model_dir=tmp_path / "model",
                load_strategy="object_store",
                ipc_dir=tmp_path / "shm",
                tp=1,
                ckpt_bucket=BUCKET,
            ),
        )
    finally:
        if bus is not None:
            await bus.close()
        node.stop()


async def test_a_refused_look_is_reported_refused_not_unanswered(engine: Any) -> None:
    why = await pending(engine, "v2", sure=True)
    assert why is not None
    assert "m/v2/manifest.json: refused (403): permission denied: " in why, why
    assert f"$JS.API.DIRECT.GET.OBJ_{BUCKET}." in why, why
    assert "no answer" not in why
    assert engine.bus.pending == 0 and not engine.bus.nc._asked
    # not sure: the update decides (the ranks' credentials may read the bucket), as before
    assert await pending(engine, "v2") is None
    # a version refused so is not served meanwhile
    idx = index_of(engine)
    for seq, v in enumerate(("v1", "v2", "v3"), 1):
        idx.add(v, seq)
    assert await _meanwhile(engine, "v3", set(), {"v2"}) is None
