"""``rollbus versions`` / ``rollbus publish`` against a nats-server whose checkpoint stream
does not exist yet and whose roles may not create it (infra/nats/auth.conf: only the
engine creates it at its start): one line saying so, exit 2 — was an ``ObjectReadError``
traceback."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.tiny_model import ensure_tiny_model
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
            assert "ROLLBUS_CKPT" in err and "rollbus serve" in err, (role, args, err)
            assert passwords[role] not in err, err
            assert "lack publish permission on $JS.API." in err, (role, args, err)
    finally:
        node.stop()
