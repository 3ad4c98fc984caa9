"""The same-host shared-memory all-reduce of the CPU ranks, between real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.worker.shmreduce import ShmAllReduce, ShmReduceError, segment_dir

SHAPES = [(1, 64), (16, 64), (3, 7), (16, 64), (1, 1), (5, 64)]  # > 2 calls: both slots reused
SLOT = 16 * 64 * 4
CTX = mp.get_context("spawn")


def operands(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _rank(rank: int, tp: int, d: str, barrier: Any, q: Any, mode: str) -> None:
    seen: dict[str, Any] = {}

    def sync() -> None:
        barrier.wait(timeout=60)
        if "files" not in seen:  # every rank's file exists now
            seen["files"] = {p.name: stat.S_IMODE(p.stat().st_mode) for p in Path(d).iterdir()}
            seen["dir"] = stat.S_IMODE(os.stat(d).st_mode)

    ar = ShmAllReduce(rank, tp, SLOT, Path(d), sync, timeout_s=60)
    if mode == "absent":  # joined, then never calls
        q.put(("joined", rank))
        time.sleep(120)
        return
    if mode == "exit":
        q.put(("joined", rank))
        return
    out = [ar.reduce(a) for a in operands(rank)]
    q.put((rank, out, seen, Path(d).exists()))
    ar.close()


def start(tp: int, d: Path, modes: dict[int, str]) -> tuple[list[Any], Any, Any]:
    barrier, q = CTX.Barrier(tp), CTX.Queue()
    procs = [
        CTX.Process(target=_rank, args=(r, tp, str(d), barrier, q, modes.get(r, "")), daemon=True)
        for r in range(1, tp)
    ]
    for p in procs:
        p.start()
    return procs, barrier, q


@pytest.mark.parametrize("tp", [2, 3])
def test_every_rank_gets_the_same_bits_of_the_sum_in_rank_order(tmp_path: Path, tp: int) -> None:
    d = segment_dir(tmp_path, "127.0.0.1:1,127.0.0.1:2")
    procs, barrier, q = start(tp, d, {})
    _rank(0, tp, str(d), barrier, q, "")
    results = {}
    for _ in range(tp):
        rank, out, seen, dir_left = q.get(timeout=60)
        results[rank] = out
        assert seen["files"] == {f"rank{r}": 0o600 for r in range(tp)}  # private files...
        assert seen["dir"] == 0o700  # ...in a private directory
        assert not dir_left  # unlinked once every rank mapped them
    for p in procs:
        p.join(30)
    ops = [operands(r) for r in range(tp)]
    for i in range(len(SHAPES)):
        want = ops[0][i] + ops[1][i]
        for r in range(2, tp):
            want = want + ops[r][i]
        for r in range(tp):
            assert results[r][i].tobytes() == want.tobytes()  # bit-identical on every rank
        np.testing.assert_allclose(want, np.sum([o[i] for o in ops], axis=0), rtol=1e-5)


def test_a_peer_that_never_arrives_is_named_within_the_bound(tmp_path: Path) -> None:
    d = segment_dir(tmp_path, "k")
    barrier = CTX.Barrier(2)
    q = CTX.Queue()
    peer = CTX.Process(target=_rank, args=(1, 2, str(d), barrier, q, "absent"), daemon=True)
    peer.start()
    try:
        ar = ShmAllReduce(0, 2, SLOT, d, lambda: barrier.wait(timeout=60), timeout_s=0.5)
        assert q.get(timeout=60) == ("joined", 1)
        t0 = time.monotonic()
        with pytest.raises(ShmReduceError, match=r"rank 1 did not arrive within 0.5s"):
            ar.reduce(np.ones((1, 64), np.float32))
        assert time.monotonic() - t0 < 30
    finally:
        peer.kill()
        peer.join(10)


def test_a_peer_process_that_is_gone_is_named_without_waiting_for_the_bound(
    tmp_path: Path,
) -> None:
    d = segment_dir(tmp_path, "k")
    barrier = CTX.Barrier(2)
    q = CTX.Queue()
    peer = CTX.Process(target=_rank, args=(1, 2, str(d), barrier, q, "exit"))
    peer.start()
    ar = ShmAllReduce(0, 2, SLOT, d, lambda: barrier.wait(timeout=60), timeout_s=600)
    assert q.get(timeout=60) == ("joined", 1)
    peer.join(30)
    with pytest.raises(ShmReduceError, match=r"rank 1 \(pid \d+\) is gone"):
        ar.reduce(np.ones((1, 64), np.float32))


def test_a_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(ShmReduceError, match="not a private directory"):
        ShmAllReduce(0, 2, SLOT, d, lambda: None, timeout_s=1)


@pytest.mark.parametrize(
    ("machine", "tp", "endpoints", "mode", "shared"),
    [
        ("x86_64", 2, "127.0.0.1:1,127.0.0.1:2", "shm", True),
        ("aarch64", 2, "127.0.0.1:1,127.0.0.1:2", "shm", False),  # stores may be reordered
        ("x86_64", 2, "127.0.0.1:1,10.0.0.2:2", "shm", False),  # a rank on another host
        ("x86_64", 2, "127.0.0.1:1,127.0.0.1:2", "gloo", False),
        ("x86_64", 1, "127.0.0.1:1", "shm", False),
    ],
)
def test_shared_memory_only_where_it_is_safe(
    monkeypatch: pytest.MonkeyPatch, machine: str, tp: int, endpoints: str, mode: str,
    shared: bool,
) -> None:
    from types import SimpleNamespace

    from services.worker import main

    monkeypatch.setattr(main.platform, "machine", lambda: machine)
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", endpoints)
    settings = SimpleNamespace(tp=tp, device="cpu", tp_allreduce=mode, max_step_tokens=8)
    got = main.shm_bytes(settings, SimpleNamespace(hidden_size=4))  # type: ignore[arg-type]
    assert got == (8 * 4 * 4 if shared else 0)
