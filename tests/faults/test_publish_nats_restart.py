"""nats-server killed and started again (same store) while ``rollbus publish`` uploads:
the publish ends in bounded time with one line (no traceback, no hang), announces
nothing, and a retry publishes the version whole; the failed publish's chunks do not
stay in the bucket. A real CLI process, a real nats-server SIGKILLed and restarted."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import nats
from safetensors.numpy import save_file

from services.tiny_model import TINY_CONFIG
from shared import manifest as mf
from shared import objstore, sharding
from shared.model_config import ModelConfig
from shared.subjects import ckpt_object_name
from tests.clirun import clean_env
from tests.faults.common import NatsProc
from tests.faults.test_publish_killed import (
    BUCKET,
    PART,
    STREAM,
    _chunks,
    _model_dir,
    _publish_argv,
)


async def _bytes(url: str) -> int:
    nc = await nats.connect(url)
    try:
        try:
            return int((await nc.jetstream().stream_info(STREAM)).state.bytes)
        except Exception:  # noqa: BLE001 - no bucket yet
            return 0
    finally:
        await nc.close()


async def _claim_nuids(url: str, model: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        _, marker = await objstore.last_meta(
            nc, BUCKET, ckpt_object_name(model, "v1", "manifest.json")
        )
        return list(marker.get("claim", {}).get("nuids", []))
    finally:
        await nc.close()


def test_nats_restart_mid_publish_fails_in_one_line_and_a_retry_publishes(
    tmp_path: Path,
) -> None:
    server = NatsProc(tmp_path / "store", tmp_path / "nats.log")
    try:
        d = _model_dir(tmp_path / "m")
        model = f"nr-{uuid.uuid4().hex[:6]}"
        env = clean_env(tmp_path / "data")
        p = subprocess.Popen(
            _publish_argv(d, model, server.url),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            while asyncio.run(_bytes(server.url)) < PART:
                assert p.poll() is None, p.communicate()
                time.sleep(0.02)
            nuids = asyncio.run(_claim_nuids(server.url, model))
            server.kill(signal.SIGKILL)
            time.sleep(0.5)
            server.start()
            t0 = time.monotonic()
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        took = time.monotonic() - t0
        errors = [x for x in err.splitlines() if x.strip() and "MiB/s" not in x]
        assert p.returncode == 2 and not out, (p.returncode, out, err)
        assert len(errors) == 1 and errors[0].startswith("rollbus publish: "), err
        assert took < 90, took

        again = subprocess.run(
            _publish_argv(d, model, server.url),
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert again.returncode == 0, again.stderr

        async def check() -> None:
            nc = await nats.connect(server.url)
            try:
                raw = await objstore.read_object(
                    nc, BUCKET, ckpt_object_name(model, "v1", "manifest.json")
                )
                man = mf.decode(bytes(raw))
                for s in man.shards:
                    data = await objstore.read_object(
                        nc, BUCKET, ckpt_object_name(model, "v1", s.file)
                    )
                    assert hashlib.sha256(data).hexdigest() == s.sha256
                assert [e.version for _, e in await objstore.list_versions(nc, model)] == ["v1"]
                js = nc.jetstream()
                for nuid in nuids:  # the failed publish's chunks: purged
                    assert await _chunks(js, nuid) == 0, nuid
            finally:
                await nc.close()

        asyncio.run(check())
    finally:
        server.stop()


# the CLI as a user runs it, which stops itself once the manifest is written, before the
# version's event is published (the test kills nats-server there, then SIGCONT; the
# server is started again once the publisher has ended: no race with its reconnect)
STOP_BEFORE_ANNOUNCE = """
import os, signal, sys
from services.trainer import publisher
announce = publisher.CheckpointPublisher._announce
async def stopping_announce(self, nc, man):
    os.kill(os.getpid(), signal.SIGSTOP)
    return await announce(self, nc, man)
publisher.CheckpointPublisher._announce = stopping_announce
from services.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_nats_restart_between_manifest_and_event_is_one_line_and_a_retry_announces(
    tmp_path: Path,
) -> None:
    server = NatsProc(tmp_path / "store", tmp_path / "nats.log")
    try:
        # a small checkpoint: nothing is killed mid-upload here (the upload ends first)
        d = tmp_path / "m"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(TINY_CONFIG))
        cfg = ModelConfig.from_hf(TINY_CONFIG)
        save_file(sharding.init_weights(cfg, 5), str(d / "model.safetensors"))
        model = f"na-{uuid.uuid4().hex[:6]}"
        env = clean_env(tmp_path / "data")
        argv = _publish_argv(d, model, server.url)
        p = subprocess.Popen(
            [argv[0], "-c", STOP_BEFORE_ANNOUNCE, *argv[3:]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            for _ in range(6000):
                if p.poll() is not None or _proc_state(p.pid) == "T":
                    break
                time.sleep(0.02)
            assert p.poll() is None, p.communicate()
            server.kill(signal.SIGKILL)  # started again once the publisher has ended
            p.send_signal(signal.SIGCONT)
            out, err = p.communicate(timeout=120)
            server.start()
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        lines = [x for x in err.splitlines() if x.strip() and "MiB/s" not in x]
        assert p.returncode == 2 and not out and len(lines) == 1, (out, err)
        # what happened and what to do: before, only "nats: timeout"
        assert f"{model}/v1 is stored but its event was not published" in lines[0], err
        assert "publish it again" in lines[0], err
        again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
        assert again.returncode == 0, again.stderr

        async def announced() -> list[str]:
            nc = await nats.connect(server.url)
            try:
                return [e.version for _, e in await objstore.list_versions(nc, model)]
            finally:
                await nc.close()

        assert asyncio.run(announced()) == ["v1"]
    finally:
        server.stop()


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
