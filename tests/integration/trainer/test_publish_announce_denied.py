"""``rollbus publish`` with credentials that may upload a version but not announce it
(no publish permission on ``rollbus.ckpt.<model>.published``): the version is stored, and
the one line says the credentials lack that permission — not "publish it again to
announce it", which cannot help (the retry is refused alike)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.tiny_model import ensure_tiny_model
from shared import objstore
from shared.bus import Bus
from tests import natsconf
from tests.clirun import clean_env, rollbus

EVENT = '"rollbus.ckpt.*.published", '  # the trainer's permission this test takes away


async def _engine_creates_streams(url: str) -> None:
    bus = await Bus.connect(url, "test-engine")
    try:
        await objstore.ensure_ckpt_stream(bus.nc, "m")
        await objstore.ensure_bucket(bus.nc, "rollbus_ckpt")
    finally:
        await bus.close()


def test_an_event_the_credentials_may_not_publish_is_named(tmp_path: Path) -> None:
    passwords = natsconf.role_passwords()
    node = natsconf.single_with_auth(tmp_path, passwords)
    auth = (tmp_path / "auth.conf").read_text()
    assert EVENT in auth
    (tmp_path / "auth.conf").write_text(auth.replace(EVENT, ""))
    node.start()
    try:
        asyncio.run(
            _engine_creates_streams(f"nats://engine:{passwords['engine']}@127.0.0.1:{node.port}")
        )
        env = clean_env(tmp_path / "data")
        model = ensure_tiny_model(tmp_path / "model")
        url = f"nats://trainer:{passwords['trainer']}@127.0.0.1:{node.port}"
        r = rollbus(
            "publish", str(model), "--model", "m", "--version", "v1", "--nats-url", url, env=env
        )
        err = r.stderr.strip().splitlines()[-1]  # after the upload's progress line
        assert r.returncode == 2 and err.startswith("rollbus publish: "), r.stderr
        assert "m/v1 is stored but its event was not published" in err, err
        assert "lack publish permission on rollbus.ckpt.m.published" in err, err
        assert "publishing again cannot announce it" in err and "publish it again" not in err, err
    finally:
        node.stop()
