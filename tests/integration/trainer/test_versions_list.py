"""``rollbus versions`` lists each version once, at its first announcement (the order
every engine uses), and prints an event's free-text ``publisher`` as one short inert
field. Real nats-server; the SDK publishes, a raw nats-py client (as ``nats pub`` could)
re-announces an old version and sends a hostile ``publisher``. Before, a re-announced
version was listed again under its new sequence (two rows, in the wrong place), and a
1 MB or escape-laden ``publisher`` went to the terminal as is."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import nats

from services.tiny_model import create_model_dir
from services.trainer.publisher import CheckpointPublisher
from shared.subjects import ckpt_published
from tests.clirun import clean_env, rollbus


async def _announce(url: str, model: str, version: str, msg_id: str, publisher: str) -> None:
    nc = await nats.connect(url)
    try:
        body = {"model": model, "version": version, "tp": 1, "publisher": publisher}
        await nc.jetstream().publish(
            ckpt_published(model), json.dumps(body).encode(), headers={"Nats-Msg-Id": msg_id}
        )
    finally:
        await nc.close()


def test_versions_lists_first_announcements_and_inert_publishers(
    nats_url: str, tmp_path: Path
) -> None:
    d = create_model_dir(tmp_path / "m")
    model = f"ls-{uuid.uuid4().hex[:6]}"
    pub = CheckpointPublisher(nats_url)
    pub.publish(model, "v1", d, tp=1)
    pub.publish(model, "v2", d, tp=1)
    asyncio.run(_announce(nats_url, model, "v1", "again-1", "x"))  # v1 once more, seq 3
    asyncio.run(_announce(nats_url, model, "v3", "v3", "\x1b[2J\x1b]0;owned\x07" + "p" * 10**6))
    r = rollbus("versions", "--model", model, "--nats-url", nats_url, env=clean_env(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = [line.split()[1] for line in r.stdout.splitlines()[1:]]
    assert rows == ["v1", "v2", "v3"], r.stdout
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) < 200
