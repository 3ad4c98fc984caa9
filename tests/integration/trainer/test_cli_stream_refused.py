"""``rollbus versions`` / ``rollbus publish`` against a nats-server whose checkpoint stream
does not exist yet and whose roles may not create it (infra/nats/auth.conf: only the
engine creates it at its start): one line saying so, exit 2 — was an ``ObjectReadError``
traceback."""

from __future__ import annotations

import asyncio
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.tiny_model import ensure_tiny_model
from shared import objstore
from shared.bus import Bus
from tests import natsconf
from tests.clirun import clean_env, rollbus


def test_a_stream_the_role_may_not_create_is_one_line(tmp_path: Path) -> None:
    passwords = natsconf.role_passwords()
    node = natsconf.single_with_auth(tmp_path, passwords)
    node.start()
    try:
        env = clean_env(tmp_path / "data")
        model = ensure_tiny_model(tmp_path / "model")
        calls = [
            (role, args)
            for role in ("trainer", "operator")
            for args in (
                ["versions", "--model", "m"],
                ["publish", str(model), "--model", "m", "--version", "v1"],
            )
        ]

        def run(role: str, args: list[str]) -> subprocess.CompletedProcess[str]:
            url = f"nats://{role}:{passwords[role]}@127.0.0.1:{node.port}"
            return rollbus(*args, "--nats-url", url, env=env)

        # at once (named by the server's permissions violation; before, each call waited
        # out its 5 s JetStream API timeout and said only "no answer")
        with ThreadPoolExecutor(len(calls)) as pool:
            done = list(pool.map(lambda c: run(*c), calls))
        for (role, args), r in zip(calls, done, strict=True):
            err = r.stderr.strip()
            assert r.returncode == 2, (role, args, err)
            assert "Traceback" not in err and len(err.splitlines()) == 1, (role, args, err)
            # the trainer's may not create it; the operator's may not even look
            advice = "rollbus serve" if role == "trainer" else "trainer's credentials"
            assert "ROLLBUS_CKPT" in err and advice in err, (role, args, err)
            assert passwords[role] not in err, err
            assert "lack publish permission on $JS.API." in err, (role, args, err)
    finally:
        node.stop()


def test_a_stream_the_role_may_not_even_look_at_is_not_blamed_on_serve(tmp_path: Path) -> None:
    """The stream exists (the engine made it) and the operator's credentials may not
    even ask about it: starting ``rollbus serve`` cannot help, so the line must not
    advise it, but name whose credentials can."""
    passwords = natsconf.role_passwords()
    node = natsconf.single_with_auth(tmp_path, passwords)
    node.start()
    try:
        asyncio.run(_engine_creates_streams(node.port, passwords["engine"]))
        url = f"nats://operator:{passwords['operator']}@127.0.0.1:{node.port}"
        r = rollbus("versions", "--model", "m", "--nats-url", url, env=clean_env(tmp_path / "d"))
        err = r.stderr.strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1, err
        assert "lack publish permission on $JS.API.STREAM.INFO.ROLLBUS_CKPT" in err, err
        assert "rollbus serve" not in err and "trainer's credentials" in err, err
    finally:
        node.stop()


async def _engine_creates_streams(port: int, password: str) -> None:
    bus = await Bus.connect(f"nats://engine:{password}@127.0.0.1:{port}", "test-engine")
    try:
        await objstore.ensure_ckpt_stream(bus.nc, "m")
    finally:
        await bus.close()
