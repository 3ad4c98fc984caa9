"""A version whose stored ``manifest.json`` is garbage (written by hand, a foreign
writer, a corrupt store): publishing that version again is refused in one line — the
version exists and versions are immutable — never a traceback. Real CLI process, real
nats-server."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import nats
from safetensors.numpy import save_file

from services.tiny_model import TINY_CONFIG
from shared import objstore, sharding
from shared.model_config import ModelConfig
from shared.subjects import ckpt_object_name
from tests.clirun import clean_env, rollbus

BUCKET = "rollbus_ckpt"


async def _put_garbage(url: str, model: str) -> None:
    nc = await nats.connect(url)
    try:
        await objstore.ensure_bucket(nc, BUCKET)
        name = ckpt_object_name(model, "v1", "manifest.json")
        await objstore.put_object(nc, BUCKET, name, b"\x00not json{")
    finally:
        await nc.close()


def test_republishing_a_version_with_a_garbage_manifest_is_one_line(
    nats_url: str, tmp_path: Path
) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    save_file(
        sharding.init_weights(ModelConfig.from_hf(TINY_CONFIG), 3), str(d / "model.safetensors")
    )
    model = f"gm-{uuid.uuid4().hex[:6]}"
    asyncio.run(_put_garbage(nats_url, model))
    r = rollbus(
        *("publish", str(d), "--model", model, "--version", "v1", "--tp", "1"),
        *("--nats-url", nats_url),
        env=clean_env(tmp_path / "data"),
    )
    assert r.returncode == 2 and not r.stdout, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("rollbus publish: ") and "manifest.json" in lines[0], lines
    assert "already published" in lines[0], lines
