"""Tensor parallelism is exact: two gloo ranks (real subprocesses, no
paddle.distributed.launch) produce the same logits and greedy tokens as one rank."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
HELPER = HERE / "tp_equivalence_rank.py"
TIMEOUT_S = 120.0


def load_helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tp_equivalence_rank", HELPER)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_env(rank: int, endpoints: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_DISTRI_BACKEND": "gloo",
        "GLOO_SOCKET_IFNAME": "lo",  # keep gloo's own sockets on loopback
        "OMP_NUM_THREADS": "1",  # 2 ranks + this process share 2 cores
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    })
    return env


def test_tp2_matches_tp1(tmp_path: Path) -> None:
    endpoints = [f"127.0.0.1:{p}" for p in free_ports(2)]
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    outs = [tmp_path / f"rank{r}.npz" for r in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for r in range(2):
            with logs[r].open("wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(HELPER), str(outs[r])], cwd=ROOT,
                    env=rank_env(r, endpoints), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))
        reference = load_helper().run_scenario(0, 1, None)  # tp=1 while the ranks start up
        for r, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"rank {r} exit {code}:\n{logs[r].read_text()[-3000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                # The rank's session holds any helper processes paddle started; end them too.
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    ranks = [np.load(o) for o in outs]
    assert np.abs(reference["logits"]).max() > 1.0  # meaningful, not all ~0
    for r, result in enumerate(ranks):
        assert result["logits"].shape == reference["logits"].shape
        diff = np.abs(result["logits"] - reference["logits"]).max()
        assert diff < 1e-4, f"rank {r}: max |tp2 - tp1| = {diff}"
        np.testing.assert_array_equal(result["tokens"], reference["tokens"])
