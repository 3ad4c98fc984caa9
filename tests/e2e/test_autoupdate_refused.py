"""Auto-update when the newest version can never load here (sharded for another tp: a
422, for good): a fresh start catches up to the newest version it *can* load (before, it
stayed on ``v0``). The refused one still counts toward staleness — the bound counts
published versions — so with ``MAX_STALENESS=0`` new requests wait for a newer loadable
version (tests/e2e/test_staleness.py shows them start once one is published). An engine
restarted from its stored state still knows what it refused: it does not try it again.
A real TP=1 stack on the session's nats-server, versions published with the SDK."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from services.tiny_model import create_model_dir
from services.trainer.publisher import CheckpointPublisher
from shared import objstore
from shared.messages import VersionPublished
from shared.subjects import ckpt_published
from tests.e2e.stack import model_config, running_stack
from tests.e2e.test_checkpoints import _raw, events, training_state, wait_for


def test_fresh_start_skips_a_version_it_cannot_load_and_stays_behind_it(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = Path(tmp_path_factory.mktemp("refused"))
    name = f"ref-{uuid.uuid4().hex[:6]}"
    model_dir = tmp / "models" / name
    create_model_dir(model_dir, None, seed=0)
    cfg = model_config(model_dir)
    pub = CheckpointPublisher(nats_url)

    d = SimpleNamespace(model_dir=model_dir)  # all training_state reads of a stack
    pub.publish(name, "good", training_state(d, 1), tp=1, config=cfg)  # type: ignore[arg-type]
    pub.publish(name, "tp2", training_state(d, 2), tp=2, config=cfg)  # type: ignore[arg-type]
    env = {
        "ROLLBUS_AUTO_UPDATE": "true",
        "ROLLBUS_MAX_STALENESS": "0",
        "ROLLBUS_LOAD_STRATEGY": "object_store",
    }
    with running_stack(tmp, nats_url, tp=1, model_name=name, model_dir=model_dir, env=env) as s:
        wait_for(lambda: s.status()["weight_version"] == "good", 60)
        st = s.status()["staleness"]
        assert st["behind"] == 1 and st["stale"] and st["newest"] == "tp2", st

        def failed(version: str) -> list[dict[str, Any]]:
            got = [e["data"] for e in events(s, "auto_update")]
            return [e for e in got if e["version"] == version and e["action"] == "failed"]

        wait_for(lambda: bool(failed("tp2")))
        old = s.status()["engine_pid"]
        os.kill(old, signal.SIGKILL)  # the launcher restarts it: it restores its state

        def restored() -> bool:
            try:
                st = s.status()
            except Exception:  # noqa: BLE001 - 503 while it restarts
                return False
            return bool(st["engine_pid"] != old and st["ranks_ready"])

        wait_for(restored, 90)
        pub.publish(name, "tp2b", training_state(d, 3), tp=2, config=cfg)  # type: ignore[arg-type]
        wait_for(lambda: bool(failed("tp2b")), 60)
        # the refusal names no next version: tp2 was refused before the restart (before,
        # forgotten: tried again, one more pause and 422)
        assert failed("tp2b")[0]["next"] is None, failed("tp2b")
        assert len(failed("tp2")) == 1 and s.status()["weight_version"] == "good"
        assert s.status()["staleness"]["behind"] == 2  # both still count

        # tp2's event again (re-announced past the dedup window, or redelivered to an
        # engine that died before acking it): ignored, no pause (before: tried again —
        # a pause, the same 422, a resume)
        states = len(events(s, "state"))
        ev = VersionPublished(name, "tp2", 2)

        async def again(nc: Any) -> Any:
            return await nc.jetstream().publish(
                ckpt_published(name),
                msgspec.json.encode(ev),
                headers={objstore.MSG_ID: f"{name}/tp2/{uuid.uuid4().hex}"},
            )

        asyncio.run(_raw(nats_url, again))

        def ignored() -> list[dict[str, Any]]:
            got = [e["data"] for e in events(s, "auto_update")]
            return [e for e in got if e["version"] == "tp2" and e["action"] == "ignored"]

        wait_for(lambda: bool(ignored()), 60)
        assert "refused" in ignored()[0]["reason"], ignored()
        assert len(failed("tp2")) == 1 and events(s, "state")[states:] == []
