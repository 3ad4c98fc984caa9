"""`rollbus serve` against an external server with roles (infra/nats/single.conf +
auth.conf, credentials from ROLLBUS_NATS_CREDS_DIR), and with the embedded server on TLS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import nats

from shared import creds
from tests import natsconf
from tests.e2e.stack import free_port, wait_healthy
from tests.integration.test_nats_tls import make_ca_and_server_cert


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    env.update(ROLLBUS_LOG_LEVEL="warning", ROLLBUS_TP="1", **kw)
    return env


def _serve(cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = cwd / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"], cwd=cwd, env=env,
        stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
    )
    return proc, log


async def _pause_resume(url: str, tls: ssl.SSLContext | None = None) -> None:
    nc = await nats.connect(url, tls=tls) if tls else await nats.connect(url)
    try:
        for method in ("pause", "resume"):
            rep = await nc.request(f"rollbus.default.ctl.{method}", b"{}", timeout=30)
            assert json.loads(rep.data)["error_code"] == 200
    finally:
        await nc.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_external_server_with_roles(tmp_path: Path) -> None:
    passwords = natsconf.role_passwords()
    node = natsconf.single_with_auth(tmp_path, passwords)
    node.start()
    try:
        # without credentials for an authenticating server: one clear line, exit 2
        r = subprocess.run(
            [sys.executable, "-m", "services.cli", "serve"], cwd=tmp_path,
            env=_env(ROLLBUS_NATS_URL=node.url, ROLLBUS_API_PORT=str(free_port()),
                     ROLLBUS_DATA_DIR=str(tmp_path / "nocreds")),
            capture_output=True, text=True, timeout=60,
        )
        assert r.returncode == 2 and "authorization violation" in r.stderr, r.stderr

        cdir = natsconf.write_creds_dir(tmp_path / "creds", passwords)
        api = free_port()
        env = _env(ROLLBUS_NATS_URL=node.url, ROLLBUS_NATS_CREDS_DIR=str(cdir),
                   ROLLBUS_API_PORT=str(api), ROLLBUS_DATA_DIR=str(tmp_path / "d"))
        proc, log = _serve(tmp_path, env)
        try:
            wait_healthy(f"http://127.0.0.1:{api}", proc, log)
            r = subprocess.run(
                [sys.executable, "-m", "services.cli", "creds", "operator"], cwd=tmp_path,
                env=env, capture_output=True, text=True, timeout=60,
            )
            assert r.stdout.strip() == creds.with_creds(node.url, "operator",
                                                        passwords["operator"])
            asyncio.run(_pause_resume(r.stdout.strip()))
            assert not [p for p in passwords.values() if p in log.read_text()]
        finally:
            _stop(proc)
    finally:
        node.stop()


def test_embedded_server_on_tls(tmp_path: Path) -> None:
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    api, nport = free_port(), free_port()
    env = _env(ROLLBUS_API_PORT=str(api), ROLLBUS_NATS_PORT=str(nport),
               ROLLBUS_NATS_TLS_CERT=str(cert), ROLLBUS_NATS_TLS_KEY=str(key),
               ROLLBUS_NATS_TLS_CA=str(ca))
    proc, log = _serve(tmp_path, env)
    try:
        wait_healthy(f"http://127.0.0.1:{api}", proc, log)
        r = subprocess.run(
            [sys.executable, "-m", "services.cli", "creds", "operator"], cwd=tmp_path,
            env=env, capture_output=True, text=True, timeout=60,
        )
        url = r.stdout.strip()
        assert url.startswith("tls://operator:") and url.endswith(f"@127.0.0.1:{nport}")
        asyncio.run(_pause_resume(url, ssl.create_default_context(cafile=str(ca))))
    finally:
        _stop(proc)
