"""Fixtures of the compatibility suite: model dirs built with transformers, its answers,
and rollbus's answers at TP=2 from two real gloo ranks (one pair for every case).

Needs torch and transformers (``just compat`` installs a CPU torch); ``just test``
does not collect this directory."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
try:
    import hf  # noqa: E402
except ImportError as e:  # pragma: no cover - depends on the machine
    raise pytest.UsageError(
        f"tests/compat needs torch and transformers ({e}); run `just compat`"
    ) from None
from cases import CASES, NEW_TOKENS, PROMPTS  # noqa: E402

from tests.rankprocs import rank_processes, wait_ok  # noqa: E402

TP2_TIMEOUT_S = 600.0
COMPAT_TIMEOUT_S = 1200  # a test's share includes building every model (session fixtures)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(COMPAT_TIMEOUT_S))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compat-models")
    return {c.name: hf.build(c, root / c.name, PROMPTS, NEW_TOKENS) for c in CASES}


@pytest.fixture(scope="session")
def references(model_dirs: dict[str, Path]) -> dict[tuple[str, int], dict[str, Any]]:
    return {
        (c.name, i): hf.reference(model_dirs[c.name], p, NEW_TOKENS)
        for c in CASES
        for i, p in enumerate(PROMPTS)
    }


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="session")
def tp2_results(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], list[dict[str, np.ndarray]]]:
    """Every (case, prompt) run by two gloo ranks; both ranks' results."""
    work = tmp_path_factory.mktemp("compat-tp2")
    jobs = [
        {
            "model_dir": str(model_dirs[c.name]),
            "prompt": p,
            "new_tokens": NEW_TOKENS,
            "out": str(work / f"{c.name}.{i}"),
        }
        for c in CASES
        for i, p in enumerate(PROMPTS)
    ]
    (work / "jobs.json").write_text(json.dumps(jobs))
    endpoints = [f"127.0.0.1:{p}" for p in _free_ports(2)]
    logs = [work / f"rank{r}.log" for r in range(2)]
    deadline = time.monotonic() + TP2_TIMEOUT_S
    runs = []
    for r in range(2):
        env = dict(os.environ)
        env.update(
            PADDLE_TRAINER_ID=str(r),
            PADDLE_TRAINERS_NUM="2",
            PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
            PADDLE_CURRENT_ENDPOINT=endpoints[r],
            PADDLE_DISTRI_BACKEND="gloo",
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        )
        argv = [sys.executable, str(HERE / "rollbus_side.py"), str(work / "jobs.json")]
        runs.append((argv, env, logs[r]))
    with rank_processes(runs, ROOT) as procs:
        wait_ok(procs, logs, deadline)
    return {
        (c.name, i): [dict(np.load(work / f"{c.name}.{i}.rank{r}.npz")) for r in range(2)]
        for c in CASES
        for i in range(len(PROMPTS))
    }
