"""``rollbus publish DIR`` never imports paddle: the publish CLI runs in a process whose
import system refuses paddle (a ``sys.meta_path`` finder that raises), against a real
nats-server, and the version arrives. The same guard with paddle imported on purpose
fails, so the hook is known to bite."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from services.tiny_model import create_model_dir

RUN = """
import sys

class NoPaddle:
    def find_spec(self, name, path=None, target=None):
        if name == "paddle" or name.startswith("paddle."):
            raise ImportError(f"paddle imported by the publish path: {name}")
        return None

sys.meta_path.insert(0, NoPaddle())
if sys.argv[1] == "import-paddle":
    import paddle  # noqa: F401  (the hook's own check)
from services.cli import main

code = main(sys.argv[2:])
assert not any(m == "paddle" or m.startswith("paddle.") for m in sys.modules), "paddle loaded"
sys.exit(code)
"""


def publish(
    model_dir: Path, nats_url: str, version: str, first: str = ""
) -> subprocess.CompletedProcess[str]:
    args = ["publish", str(model_dir), "--model", model_dir.name, "--version", version]
    return subprocess.run(
        [sys.executable, "-c", RUN, first or "-", *args, "--tp", "2", "--nats-url", nats_url],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_publish_cli_never_imports_paddle(tmp_path: Path, nats_url: str) -> None:
    model_dir = create_model_dir(tmp_path / f"np-{uuid.uuid4().hex[:6]}")
    r = publish(model_dir, nats_url, "np1")
    assert r.returncode == 0, r.stderr
    assert f"published {model_dir.name}/np1: tp=2" in r.stdout
    # the hook refuses paddle when something does import it
    bad = publish(model_dir, nats_url, "np2", first="import-paddle")
    assert bad.returncode != 0 and "paddle imported by the publish path" in bad.stderr
