"""Auto-update when the newest version can never load here (sharded for another tp: a
422, for good): a fresh start catches up to the newest version it *can* load, and the
refused one does not count toward staleness. Before, the engine stayed on ``v0`` with
every newer version counted, so with ``MAX_STALENESS=0`` no request was ever served.
A real TP=1 stack on the session's nats-server, versions published with the SDK."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.tiny_model import create_model_dir
from services.trainer.publisher import CheckpointPublisher
from tests.e2e.stack import model_config, running_stack
from tests.e2e.test_checkpoints import training_state, wait_for
from tests.e2e.test_staleness import complete


def test_fresh_start_skips_a_version_it_cannot_load_and_is_not_stale(
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
        assert st["behind"] == 0 and not st["stale"], st
        r = complete(s)
        assert r.status_code == 200 and r.json()["weight_version"] == "good", r.text
