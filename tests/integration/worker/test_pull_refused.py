"""A rank's object-store pull that the server refuses is a 403 (README's status codes:
401/403 auth), whichever read is refused: the object's meta (PublishDenied, a 403
already) or its chunks' direct gets. The chunk refusal was an ``ObjectReadError`` like a
stall or a lost connection, so the rank said 503 ("retry") for a grant that no retry
brings. Real nats-server, the generated auth.conf with the worker's chunk grant taken
away (an auth.conf edited by hand, or one older than the code)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from services.worker.sources import ObjectStoreSource
from shared import objstore
from shared.bus import Bus
from shared.errors import FORBIDDEN, ControlError
from shared.settings import Settings
from shared.subjects import ckpt_object_name
from tests import natsconf

BUCKET = "rollbus_ckpt"
MODEL = "m"


@pytest.mark.parametrize("big", [False, True])  # nats-py's read; the fast reader's
def test_a_refused_chunk_read_is_403_at_the_rank(tmp_path: Path, big: bool) -> None:
    passwords = natsconf.role_passwords()
    worker_perms = natsconf.without("worker", f"$JS.API.DIRECT.GET.OBJ_{BUCKET}")
    node = natsconf.single_with_perms(tmp_path, passwords, {"worker": worker_perms})
    node.start()
    try:
        url = f"nats://127.0.0.1:{node.port}"

        async def setup() -> None:
            engine = await Bus.connect(
                url.replace("//", f"//engine:{passwords['engine']}@"), "t-engine"
            )
            trainer = await Bus.connect(
                url.replace("//", f"//trainer:{passwords['trainer']}@"), "t-trainer"
            )
            try:
                await objstore.ensure_bucket(engine.nc, BUCKET)
                size = objstore.FAST_READ_MIN + 5 if big else 1000
                name = ckpt_object_name(MODEL, "v1", "manifest.json")
                await objstore.put_object(trainer.nc, BUCKET, name, os.urandom(size))
            finally:
                await trainer.close()
                await engine.close()

        asyncio.run(setup())
        s = Settings(
            model="/nonexistent",
            model_name=MODEL,
            tp=1,
            ckpt_bucket=BUCKET,
            control_timeout_s=30.0,
            nats_url=url.replace("//", f"//worker:{passwords['worker']}@"),
        )
        src = ObjectStoreSource(s, None, 0, 1)  # type: ignore[arg-type]
        t0 = time.monotonic()
        with pytest.raises(ControlError) as err:
            src("v1", None)
        assert time.monotonic() - t0 < 15.0  # at once, not after a stall timeout
        assert err.value.code == FORBIDDEN, err.value
        assert "rank 0: m/v1/manifest.json: permission denied: " in err.value.message
        assert f"publish permission on $JS.API.DIRECT.GET.OBJ_{BUCKET}" in err.value.message
        assert passwords["worker"] not in err.value.message
        if src._bus is not None:
            src._io.run(src._bus.close(), 5.0)  # type: ignore[union-attr]
    finally:
        node.stop()
