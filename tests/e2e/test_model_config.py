"""A model config rollbus cannot serve exactly stops the start: one line naming the
field, exit code 2 (a configuration error, which the launcher never retries) — from
``rollbus serve`` before anything starts, and from a worker rank started on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import free_port

BASE = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
BAD = [
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type='yarn'"),
    ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope_scaling.type='longrope'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "rope_parameters.low_freq_factor"),
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 0},
     "use_sliding_window=True"),
    ({"layer_types": ["sliding_attention"]}, "layer_types[0]='sliding_attention'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 1},
     "intermediate_size=1 is less than tp=2"),
]  # fmt: skip


def _model(tmp: Path, extra: dict[str, Any]) -> Path:
    d = tmp / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**BASE, **extra}))
    return d


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    env.update(ROLLBUS_LOG_LEVEL="warning", **kw)
    return env


def _serve(model: Path, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``rollbus serve`` of ``model`` at TP=2 on free ports, run to its exit."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "serve"],
        env=_env(
            ROLLBUS_TP="2",
            ROLLBUS_MODEL=str(model),
            ROLLBUS_API_PORT=str(free_port()),
            ROLLBUS_NATS_PORT=str(free_port()),
            ROLLBUS_DATA_DIR=str(tmp_path / "data"),
        ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1] for b in BAD])
def test_serve_refuses_unsupported_config(
    tmp_path: Path, extra: dict[str, Any], needle: str
) -> None:
    model = _model(tmp_path, extra)
    proc = _serve(model, tmp_path, timeout=60)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "data" / "nats").exists()  # nothing was started


INDEX = b'{"weight_map": {"a": "model-00001-of-00002.safetensors"}}'


@pytest.mark.parametrize(
    "files,needle",
    [
        ({"pytorch_model.bin": b"x"},
         "no *.safetensors (pytorch_model.bin is not read: save with safetensors)"),
        ({"model.safetensors.index.json": INDEX},
         "model.safetensors.index.json names missing model-00001-of-00002.safetensors"),
        # a FIFO (no index): was "model.safetensors.index.json names missing model.safetensors"
        ({"model.safetensors": "fifo"}, "model.safetensors is not a regular file"),
    ],
)  # fmt: skip
def test_serve_refuses_a_dir_without_safetensors(
    tmp_path: Path, files: dict[str, bytes | str], needle: str
) -> None:
    """A servable config but no weights a rank can read (a torch ``.bin`` checkpoint, an
    index naming a file that is not there): one line at once, before anything starts —
    not each rank failing after the stack came up."""
    model = _model(tmp_path, {})
    for name, data in files.items():
        if isinstance(data, str):  # "fifo"
            os.mkfifo(model / name)
        else:
            (model / name).write_bytes(data)
    proc = _serve(model, tmp_path, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "data" / "nats").exists()  # nothing was started


def test_rank_exits_2_on_unsupported_config(tmp_path: Path, nats_url: str) -> None:
    """A rank started on such a config (the launcher's check bypassed) exits 2, which the
    launcher's restart rule (exit 3 only) never retries."""
    model = _model(tmp_path, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    proc = subprocess.run(
        [sys.executable, "-m", "services.worker", "--rank", "0"],
        env=_env(ROLLBUS_MODEL=str(model), ROLLBUS_TP="1", ROLLBUS_NATS_URL=nats_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rope_parameters.rope_type='yarn'" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("strategy", ["snapshot", "ipc"])
def test_rank_exits_2_on_a_fifo_named_like_a_weight_file(
    tmp_path: Path, nats_url: str, strategy: str
) -> None:
    """A FIFO named ``*.safetensors`` in the model dir: the rank's start opened it to read
    its dtype and waited for a writer for good (the start hung, under every strategy:
    the launcher checks the weight files only for ``snapshot``). Now it is refused at
    once: one line naming the file, exit 2 (never retried), within seconds."""
    from services.tiny_model import create_model_dir

    model = create_model_dir(tmp_path / "m", seed=0)
    os.mkfifo(model / "extra.safetensors")
    proc = subprocess.run(
        [sys.executable, "-m", "services.worker", "--rank", "0"],
        env=_env(
            ROLLBUS_MODEL=str(model),
            ROLLBUS_TP="1",
            ROLLBUS_NATS_URL=nats_url,
            ROLLBUS_LOAD_STRATEGY=strategy,
            ROLLBUS_IPC_DIR=str(tmp_path / "ipc"),
            ROLLBUS_INSTANCE=f"fifo{os.getpid()}{strategy}",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.splitlines()[-1]
    assert "cannot start: rank 0: extra.safetensors: a FIFO, not a regular file" in last, last
    assert str(model) not in last, last
