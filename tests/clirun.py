"""``rollbus …`` as a user runs it: ``python -m services.cli`` in its own process, with
none of the caller's ``ROLLBUS_*`` settings unless given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def clean_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    return {**env, "ROLLBUS_DATA_DIR": str(data_dir), **extra}


def rollbus(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
