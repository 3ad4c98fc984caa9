"""`rollbus serve` with its embedded nats-server: authentication and roles end to end.

Ops with the operator's URL from `rollbus creds`, `rollbus publish` finding the trainer's
credentials beside the stack, each child holding only its own role's credentials, and no
password in any log or response.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import pytest
from safetensors import safe_open

from shared import creds
from tests.e2e.procs import alive
from tests.e2e.stack import free_port, wait_healthy


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    env.update(ROLLBUS_LOG_LEVEL="warning", **kw)
    return env


def _cli(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _child_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


async def _ctl(url: str, method: str, body: dict[str, object]) -> dict[str, object]:
    nc = await nats.connect(url)  # as `nats req --server URL`: the default _INBOX prefix
    try:
        rep = await nc.request(
            f"rollbus.default.ctl.{method}", json.dumps(body).encode(), timeout=60
        )
        return dict(json.loads(rep.data))
    finally:
        await nc.close()


async def test_embedded_stack_defaults_roles_and_sigterm(tmp_path: Path) -> None:
    """One default start (only the ports set) for both: what `rollbus serve` makes by
    default, then the roles, then SIGTERM stops every child with exit 0 (one stack start
    less than a stack each; it was test_launcher's test_embedded_start_defaults_and_sigterm)."""
    api, nport = free_port(), free_port()
    env = _env(ROLLBUS_API_PORT=str(api), ROLLBUS_NATS_PORT=str(nport))
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=tmp_path,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,  # noqa: SIM115
    )
    try:
        wait_healthy(f"http://127.0.0.1:{api}", proc, log)
        # the defaults: tp=2, the embedded server's store, the tiny model at v0
        st = httpx.get(f"http://127.0.0.1:{api}/v1/status", timeout=10).json()
        assert st["nats_url"] == f"nats://127.0.0.1:{nport}" and st["tp"] == 2
        assert (tmp_path / ".data" / "nats" / "jetstream").is_dir()
        tiny = tmp_path / ".data" / "models" / "tiny"
        assert json.loads((tiny / "config.json").read_text())["model_type"] == "llama"
        assert (tiny / "version.txt").read_text().strip() == "v0"
        with safe_open(str(tiny / "model.safetensors"), framework="numpy") as f:
            assert "model.layers.0.self_attn.q_proj.weight" in f.keys()
        all_kids = [
            int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ]
        assert len(all_kids) == 5  # nats-server, engine, 2 ranks, api
        cdir = tmp_path / ".data" / "creds"
        passwords = {r: creds.load(cdir, r)[1] for r in creds.ROLES}

        # `rollbus creds operator` -> a URL nats-py (and the nats CLI) use as is
        r = _cli(tmp_path, env, "creds", "operator")
        assert r.returncode == 0, r.stderr
        op_url = r.stdout.strip()
        assert op_url == f"nats://operator:{passwords['operator']}@127.0.0.1:{nport}"
        assert (await _ctl(op_url, "pause", {}))["error_code"] == 200
        assert (await _ctl(op_url, "resume", {}))["error_code"] == 200
        assert _cli(tmp_path, env, "creds", "root").returncode == 2

        # no credentials, or the operator's name with a wrong password: refused
        for bad in (f"nats://127.0.0.1:{nport}", f"nats://operator:nope@127.0.0.1:{nport}"):
            with pytest.raises(nats.errors.Error, match="(?i)authorization"):
                await nats.connect(bad, allow_reconnect=False, connect_timeout=3)

        # each child has its own role's credentials and no other role's
        st = httpx.get(f"http://127.0.0.1:{api}/v1/status", timeout=10).json()
        assert st["nats_url"] == f"nats://127.0.0.1:{nport}"
        kids = [
            int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ]
        roles_seen = []
        for k in kids:
            cmd = Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "nats-server" in cmd:
                continue
            e = _child_env(k)
            role = creds.url_user(e["ROLLBUS_NATS_URL"])
            roles_seen.append(role)
            assert creds.load(cdir, role)[1] in e["ROLLBUS_NATS_URL"]
            blob = "\0".join(e.values())
            assert not [r for r, p in passwords.items() if r != role and p in blob]
        assert sorted(roles_seen) == ["api", "engine", "worker", "worker"]

        # `rollbus publish` beside the stack finds the trainer's credentials itself
        model = tmp_path / ".data" / "models" / "tiny"
        r = _cli(tmp_path, env, "publish", str(model), "--model", "tiny", "--version", "v1")
        assert r.returncode == 0, r.stderr
        r = _cli(tmp_path, env, "versions", "--model", "tiny")
        assert r.returncode == 0 and " v1 " in r.stdout, r.stderr
        # and the ranks pull it with their worker credentials (the default strategy,
        # snapshot, has no snapshot dir of v1: it comes from the object store)
        assert not (model / "versions" / "v1").exists()
        assert (await _ctl(op_url, "pause", {}))["error_code"] == 200
        rep = await _ctl(op_url, "update_weights", {"version": "v1", "verify_checksum": True})
        assert rep["error_code"] == 200, rep
        assert (await _ctl(op_url, "resume", {}))["error_code"] == 200

        # the engine's version tracking (JetStream consumer) runs under its permissions
        assert "cannot start yet" not in log.read_text()
        # nowhere a password: logs, status, the generated config is private
        texts = [log.read_text(), (tmp_path / ".data" / "nats.log").read_text(), json.dumps(st)]
        assert not [p for p in passwords.values() for t in texts if p in t]
        assert (tmp_path / ".data" / "nats" / "server.conf").stat().st_mode & 0o077 == 0
        # and nothing the stack created is readable by another user (was: DATA_DIR, the
        # default model's config and version.txt, nats/, its ports and owner files 0644/0755)
        made = [tmp_path / ".data", *(tmp_path / ".data").rglob("*")]
        shared = [str(p.relative_to(tmp_path)) for p in made if p.lstat().st_mode & 0o077]
        assert not shared, shared
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
    time.sleep(0.5)
    assert not [k for k in all_kids if alive(k)]
