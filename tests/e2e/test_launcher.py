"""`rollbus serve` as a user runs it: clean stops, start-up errors named (the default
embedded start is checked in test_nats_auth_stack.py, on the stack that test starts)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared import sharding
from shared.model_config import ModelConfig
from tests.e2e.procs import alive
from tests.e2e.stack import free_port, wait_healthy


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    env.update(ROLLBUS_LOG_LEVEL="warning", **kw)
    return env


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out |= {int(x) for x in text}
    return out


def _serve(cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=cwd,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,  # noqa: SIM115
    )


def _run_fail(tmp_path: Path, env: dict[str, str]) -> tuple[int, str]:
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.returncode, r.stderr


def test_busy_nats_port_is_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, err = _run_fail(tmp_path, _env(ROLLBUS_NATS_PORT=str(port)))
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"port {port} is busy" in lines[0] and "Traceback" not in err


def test_unreachable_nats_url_is_named(tmp_path: Path) -> None:
    code, err = _run_fail(tmp_path, _env(ROLLBUS_NATS_URL="nats://127.0.0.1:1"))
    assert code == 2
    assert "cannot reach NATS at nats://127.0.0.1:1" in err and "Traceback" not in err


def test_bad_setting_is_one_line(tmp_path: Path) -> None:
    code, err = _run_fail(tmp_path, _env(ROLLBUS_TP="two", ROLLBUS_LOAD_STRATEGY="ftp"))
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "ROLLBUS_TP" in lines[0] and "ROLLBUS_LOAD_STRATEGY" in lines[0]


def test_just_run_config_error_is_the_launchers_one_line(tmp_path: Path) -> None:
    """`just run` is `rollbus serve`, output included: an unsupported model config is the
    launcher's one line and exit 2 — `just` adds neither its echo of the recipe
    (`rollbus serve `) nor its `error: recipe `run` failed …` line."""
    just = shutil.which("just")
    if just is None:
        pytest.skip("`just` is not installed (pip install -e '.[dev]' brings rust-just)")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    env = _env(ROLLBUS_MODEL=str(model), ROLLBUS_DATA_DIR=str(tmp_path / "data"))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
    )
    r = subprocess.run(
        [just, "run"],
        cwd=Path(__file__).resolve().parents[2],  # the repository's justfile
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "model_type='gpt2' is not supported" in lines[0] and "Traceback" not in r.stderr


def test_busy_api_port_is_one_clear_line(tmp_path: Path, nats_url: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, err = _run_fail(tmp_path, _env(ROLLBUS_API_PORT=str(port), ROLLBUS_NATS_URL=nats_url))
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{port} is busy" in lines[0] and "ready" not in err


def test_plain_hf_dir_without_version_txt_then_a_dead_child_stops_it(
    tmp_path: Path, nats_url: str
) -> None:
    """A model dir with no version.txt serves as v0; the default version of
    update_weights is then the newest published one; a state dict published without a
    config is sharded by what the instance serves; the default snapshot strategy still
    loads a version published to the object store. Then, over the restart budget (0
    here), a dead child stops the stack, named. (Two tests, a stack start each, before:
    one tp=2 start for both now; the restart budget plays no part before the kill.)"""
    import numpy as np

    from services import trainer
    from services.tiny_model import create_model_dir

    model_dir = create_model_dir(tmp_path / "Qwen2.5-0.5B", seed=0)
    (model_dir / "version.txt").unlink()
    api = free_port()
    instance = f"plain{api}"
    log = tmp_path / "serve.log"
    env = _env(
        ROLLBUS_RESTART_LIMIT="0",
        ROLLBUS_API_PORT=str(api),
        ROLLBUS_NATS_URL=nats_url,
        ROLLBUS_TP="2",
        ROLLBUS_INSTANCE=instance,
        ROLLBUS_MODEL=str(model_dir),
        ROLLBUS_DATA_DIR=str(tmp_path / "d"),
    )
    proc = _serve(tmp_path, env, log)
    base = f"http://127.0.0.1:{api}"
    try:
        wait_healthy(base, proc, log)
        with httpx.Client(base_url=base, timeout=60) as c:
            st = c.get("/v1/status").json()
            assert st["weight_version"] == "v0" and st["model"] == "Qwen2.5-0.5B"
            assert c.post("/v1/pause").status_code == 200
            r = c.post("/v1/update_weights")  # nothing published, no version.txt
            assert r.status_code == 404
            assert c.get("/v1/status").json()["state"] == "paused"  # not stuck in updating
            cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
            state = {k: np.asarray(v) for k, v in sharding.init_weights(cfg, 5).items()}
            res = trainer.publish(
                "Qwen2.5-0.5B", "p1", state, tp=2, nats_url=nats_url, instance=instance
            )
            assert res.version == "p1"
            r = c.post("/v1/update_weights")  # default: the newest published
            assert r.status_code == 200, r.text
            assert r.json()["result"]["version"] == "p1"
            assert c.post("/v1/resume").status_code == 200
            body = {"model": "Qwen2.5-0.5B", "prompt": "x", "max_tokens": 3}
            out = c.post("/v1/completions", json=body).json()
            assert out["weight_version"] == "p1" and out["usage"]["completion_tokens"] == 3

            # a dead child over the restart budget: named, and the rest stop
            st = c.get("/v1/status").json()
        kids = _children(proc.pid)
        os.kill(st["ranks"][1]["pid"], signal.SIGKILL)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:  # failed before the kill: the launcher's ordered stop
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert code == 1
    assert "worker rank 1 exited" in log.read_text()
    assert "worker ranks restarted 0 times within 60s already" in log.read_text()
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)]
