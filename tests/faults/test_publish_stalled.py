"""A publisher stalled (SIGSTOP, a partition, swap) long enough for another publisher to
take its claim over and publish the version with other bytes: the taker's complete
version is what readers get, and the stalled one, when it resumes, writes nothing
readers see and fails in one line. A real ``rollbus publish`` process, stopped by a
real SIGSTOP, on a real nats-server.

The stop is placed where it hurts most: right after the claim is taken, before any
shard's put began (a put that began before the takeover was already refused by its
own compare-and-set). Before, the resumed publisher's shard puts saw the taker's
shards as the last writes and stored their metas over them — the taker's published
manifest then named bytes that were not its own, and every rank got 422 for good.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest
from safetensors.numpy import save_file

from services.trainer import publisher
from services.trainer.publisher import CheckpointPublisher
from shared import manifest as mf
from shared import objstore, sharding
from shared.model_config import ModelConfig
from shared.subjects import ckpt_object_name
from tests.clirun import clean_env
from tests.integration.trainer.test_publish_concurrent import BUCKET, CFG

# the CLI as a user runs it, which stops itself once it holds the claim (the test then
# lets it go on with SIGCONT)
STOP_AFTER_CLAIM = """
import os, signal, sys
from services.trainer import publisher
take = publisher._Claim.take
async def stopping_take(self):
    got = await take(self)
    os.kill(os.getpid(), signal.SIGSTOP)
    return got
publisher._Claim.take = stopping_take
from services.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _model_dir(d: Path, seed: int) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CFG))
    save_file(sharding.init_weights(ModelConfig.from_hf(CFG), seed), str(d / "model.safetensors"))
    return d


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def _stored(nc: Any, model: str) -> mf.Manifest:
    """The stored manifest, after checking every shard's bytes against it (as a rank
    that verifies does: a mismatch there is its 422)."""
    raw = await objstore.read_object(nc, BUCKET, ckpt_object_name(model, "v1", "manifest.json"))
    man = mf.decode(bytes(raw))
    for s in man.shards:
        data = await objstore.read_object(nc, BUCKET, ckpt_object_name(model, "v1", s.file))
        assert hashlib.sha256(data).hexdigest() == s.sha256, f"rank {s.rank}'s shard: 422"
    return man


@pytest.mark.parametrize("same", [False, True], ids=["other-bytes", "same-bytes"])
async def test_a_stalled_publisher_resumed_after_a_takeover_changes_nothing(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same: bool
) -> None:
    """Other bytes: it fails in one line. The same bytes (a trainer's retry, a second
    publisher of one checkpoint): its publish is done — the no-op a re-publish is,
    exit 0 (before, exit 2 "another publisher took this version over" for a version
    published with exactly its content)."""
    model = f"stall-{uuid.uuid4().hex[:6]}"
    argv = ["publish", str(_model_dir(tmp_path / "a", 1)), "--model", model, "--version", "v1"]
    stalled = subprocess.Popen(
        [sys.executable, "-c", STOP_AFTER_CLAIM, *argv, "--tp", "2", "--nats-url", nats_url],
        env=clean_env(tmp_path / "data"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    nc = await nats.connect(nats_url)
    try:
        for _ in range(3000):  # holds the claim, stopped
            if stalled.poll() is not None or _state(stalled.pid) == "T":
                break
            await asyncio.sleep(0.01)
        assert stalled.poll() is None and _state(stalled.pid) == "T", stalled.communicate()
        _, marker = await objstore.last_meta(
            nc, BUCKET, ckpt_object_name(model, "v1", "manifest.json")
        )
        its_chunks = marker["claim"]["nuids"]
        # the other publisher waits for the claim to go stale, takes it over, publishes
        monkeypatch.setattr(publisher, "CLAIM_STALE_S", 1.0)
        res = await CheckpointPublisher(nats_url).apublish(
            model, "v1", str(_model_dir(tmp_path / "b", 1 if same else 2)), tp=2
        )
        assert res.uploaded
        taken = await _stored(nc, model)
        stalled.send_signal(signal.SIGCONT)
        out, err = await asyncio.to_thread(stalled.communicate, timeout=60)
        errors = [x for x in err.splitlines() if x.startswith("rollbus publish:")]
        if same:
            assert stalled.returncode == 0 and not errors, (out, err)
            assert out.startswith(f"already published {model}/v1"), out
        else:
            assert stalled.returncode == 2 and not out, (out, err)
            assert len(errors) == 1 and "took this version over" in errors[0], err
        # readers get the taker's version, whole
        assert (await _stored(nc, model)).shards == taken.shards
        js = nc.jetstream()
        for nuid in its_chunks:  # and no byte of the stalled one stays behind
            info = await js.stream_info(f"OBJ_{BUCKET}", subjects_filter=f"$O.{BUCKET}.C.{nuid}")
            assert not info.state.subjects, info.state.subjects
        assert [ev.version for _, ev in await objstore.list_versions(nc, model)] == ["v1"]
    finally:
        if stalled.poll() is None:
            stalled.kill()
            stalled.communicate()
        await nc.close()
