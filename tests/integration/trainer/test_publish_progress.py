"""`rollbus publish` shows a progress bar rewritten in place when stderr is a terminal
(a real pty here), and only its final line when stderr is a pipe or a log."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import uuid
from pathlib import Path

from services.tiny_model import TINY_CONFIG, create_model_dir

# ~12 MiB fp32 at tp=2: every shard spans several 1 MiB chunks, so several acks
CFG = {**TINY_CONFIG, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}


def _cmd(model_dir: Path, url: str, version: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "publish", str(model_dir), "--model",
            model_dir.name, "--version", version, "--tp", "2", "--nats-url", url]


def _renders(err: str) -> list[str]:
    """Each drawing of the bar (a drawing starts with a carriage return)."""
    return [x for x in err.split("\r") if "MiB/s" in x and "[" in x]


def test_progress_bar_live_on_a_terminal_final_line_otherwise(
    tmp_path: Path, nats_url: str
) -> None:
    model_dir = create_model_dir(tmp_path / f"prog-{uuid.uuid4().hex[:6]}", CFG, seed=1)
    env = {**os.environ, "COLUMNS": "120"}
    # stderr on a pty: the bar is drawn while the shards go out, then the final line
    master, slave = pty.openpty()
    p = subprocess.Popen(_cmd(model_dir, nats_url, "v1"), stdout=subprocess.PIPE,
                         stderr=slave, env=env, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            b = os.read(master, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not b:
            break
        chunks.append(b)
    os.close(master)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    live = _renders(b"".join(chunks).decode(errors="replace"))
    assert len(live) >= 2, live  # rewritten in place, not just the end
    assert "-" in live[0] and "#" * 24 in live[-1]  # drawn part-done, ends full
    assert "published" in out
    # stderr a pipe: no bar redrawn, only the final line
    # (bytes: text mode would turn every \r into a newline)
    r = subprocess.run(_cmd(model_dir, nats_url, "v2"), capture_output=True, env=env,
                       timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    final = _renders(err)
    assert len(final) == 1 and "#" * 24 in final[0], err
