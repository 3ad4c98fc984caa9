"""ROLLBUS_DEVICE at start, on a paddle build without CUDA (these machines): ``gpu`` stops
``rollbus serve`` with one line and exit 2 before any rank starts; a rank started by
hand stops with exit 2 (the launcher's "configuration error, not retried"); a bad value
is one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import paddle
import pytest

from services.tiny_model import create_model_dir
from tests.e2e.stack import free_port

pytestmark = pytest.mark.skipif(
    paddle.device.is_compiled_with_cuda(), reason="this paddle build has CUDA"
)


def env(**kw: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    out.update(ROLLBUS_LOG_LEVEL="warning", PYTHONPATH=os.getcwd(), **kw)
    return out


def ours(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(("rollbus", "Traceback"))]


def test_serve_on_gpu_without_cuda_is_one_line_exit_2_no_rank(tmp_path: Path) -> None:
    model = create_model_dir(tmp_path / "m", seed=0)
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=tmp_path,
        env=env(
            ROLLBUS_DEVICE="gpu",
            ROLLBUS_MODEL=str(model),
            ROLLBUS_API_PORT=str(free_port()),
            ROLLBUS_DATA_DIR=str(tmp_path / "d"),
        ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = ours(r.stdout + r.stderr)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "ROLLBUS_DEVICE=gpu" in lines[0], lines
    assert "no CUDA support" in lines[0] and "paddlepaddle-gpu" in lines[0]
    assert not (tmp_path / "d" / "nats").exists()  # stopped before the embedded server


def test_a_rank_on_gpu_without_cuda_exits_2(tmp_path: Path, nats_url: str) -> None:
    model = create_model_dir(tmp_path / "m", seed=0)
    r = subprocess.run(
        [sys.executable, "-m", "services.worker", "--rank", "0"],
        env=env(
            ROLLBUS_DEVICE="gpu",
            ROLLBUS_TP="1",
            ROLLBUS_MODEL=str(model),
            ROLLBUS_NATS_URL=nats_url,
            ROLLBUS_INSTANCE=f"dev{os.getpid()}",
        ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 2, r.stderr  # services.worker.main.CONFIG_ERROR: never retried
    lines = ours(r.stderr)
    assert len(lines) == 1 and "cannot start" in lines[0] and "no CUDA support" in lines[0]


def test_bad_device_value_is_one_line_exit_2(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=tmp_path,
        env=env(ROLLBUS_DEVICE="cuda"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "ROLLBUS_DEVICE='cuda'" in lines[0], lines
