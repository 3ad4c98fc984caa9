"""``rollbus publish`` stopped mid-upload leaves nothing behind: a real CLI process on a
real nats-server, signalled once part of its shard is stored (no manifest yet).

* SIGTERM (a scheduler, ``timeout``): the publish is cancelled — exit 143, one line, its
  chunks purged, its claim released. Before, the default action killed the process on
  the spot: ~the shard's bytes stayed in the bucket for good and a retry waited 15 s.
* SIGKILL (nothing can run): its chunks are named in its claim, and the next publisher
  of the version purges them when it takes the claim over. Before, they stayed in the
  bucket for ever (no meta refers to them; a retry wrote new ones beside them).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import nats
import numpy as np
from nats.js.errors import NotFoundError
from safetensors.numpy import save_file

from services.tiny_model import TINY_CONFIG
from shared import objstore
from shared.model_config import ModelConfig
from shared.sharding import full_shapes
from shared.subjects import ckpt_object_name
from tests.clirun import clean_env

BUCKET = "rollbus_ckpt"
STREAM = f"OBJ_{BUCKET}"
# ~100 MiB fp32: the upload spans ~100 chunks, so a signal lands in the middle of it
CFG = {
    **TINY_CONFIG,
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
PART = 16 << 20  # stored before the signal


def _model_dir(d: Path) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CFG))
    shapes = full_shapes(ModelConfig.from_hf(CFG))
    save_file({k: np.full(s, 0.5, np.float32) for k, s in shapes.items()}, d / "model.safetensors")
    return d


async def _stored(js: Any) -> int:
    try:
        return int((await js.stream_info(STREAM)).state.bytes)
    except NotFoundError:
        return 0


async def _chunks(js: Any, nuid: str) -> int:
    info = await js.stream_info(STREAM, subjects_filter=f"$O.{BUCKET}.C.{nuid}")
    return sum((info.state.subjects or {}).values())


def _publish_argv(d: Path, model: str, url: str) -> list[str]:
    """``rollbus publish`` of ``d`` as version ``v1`` (the killed one and its retry)."""
    cli = [sys.executable, "-m", "services.cli", "publish", str(d)]
    return [*cli, "--model", model, "--version", "v1", "--tp", "1", "--nats-url", url]


def _publish(d: Path, url: str, tmp: Path, model: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _publish_argv(d, model, url),
        env=clean_env(tmp / "data"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def _signal_mid_upload(
    js: Any, d: Path, url: str, tmp: Path, model: str, sig: int
) -> tuple[subprocess.Popen[str], int, str]:
    before = await _stored(js)
    p = _publish(d, url, tmp, model)
    while await _stored(js) < before + PART:
        assert p.poll() is None, p.communicate()
        await asyncio.sleep(0.01)
    p.send_signal(sig)
    _, err = await asyncio.to_thread(p.communicate, timeout=60)
    return p, before, err


async def test_sigterm_mid_upload_purges_its_chunks_and_releases_the_claim(
    nats_url: str, tmp_path: Path
) -> None:
    d = _model_dir(tmp_path / "m")
    model = f"term-{uuid.uuid4().hex[:6]}"
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        p, before, err = await _signal_mid_upload(js, d, nats_url, tmp_path, model, signal.SIGTERM)
        assert p.returncode == 128 + signal.SIGTERM, err
        assert f"stopped (SIGTERM): {model}/v1 not published" in err
        # what remains is a few meta messages, not the shard's bytes
        assert await _stored(js) - before < 64 << 10
        _, claim = await objstore.last_meta(
            nc, BUCKET, ckpt_object_name(model, "v1", "manifest.json")
        )
        assert claim.get("deleted") and "claim" not in claim  # released: a retry goes at once
        assert await objstore.list_versions(nc, model) == []
    finally:
        await nc.close()


async def test_sigkill_mid_upload_chunks_purged_by_the_next_publisher(
    nats_url: str, tmp_path: Path
) -> None:
    d = _model_dir(tmp_path / "m")
    model = f"kill-{uuid.uuid4().hex[:6]}"
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        p, _, err = await _signal_mid_upload(js, d, nats_url, tmp_path, model, signal.SIGKILL)
        assert p.returncode == -signal.SIGKILL, err
        _, marker = await objstore.last_meta(
            nc, BUCKET, ckpt_object_name(model, "v1", "manifest.json")
        )
        nuids = marker["claim"]["nuids"]
        assert len(nuids) == 1 and await _chunks(js, nuids[0]) > 0  # left by the dead one
        assert await objstore.list_versions(nc, model) == []  # never announced
        again = await asyncio.to_thread(
            subprocess.run,
            _publish_argv(d, model, nats_url),
            env=clean_env(tmp_path / "data"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0, again.stderr
        assert await _chunks(js, nuids[0]) == 0  # purged with the takeover
        assert [ev.version for _, ev in await objstore.list_versions(nc, model)] == ["v1"]
    finally:
        await nc.close()
