"""One rank for test_comm_groups.py: ``python comm_groups_rank.py RANK TP ENDPOINTS BUILDS``.

Joins the gloo group with :class:`CommGroup` (the TP group built once), then sleeps and
wakes up ``BUILDS`` times through the worker's own handlers with
``SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE`` (:func:`control.sleep` destroys the TP group,
:func:`control.wakeup` builds it again), checking every other group with an all-reduce on
the group the model holds, as its steps do; the others are destroyed as soon as this rank
has built them (a sleep queued behind a wakeup), rank 0 first in the build and the others
0.3 s late. Exit 0 when every group worked; a failed build raises (exit 1, the error on
stderr). The last line reports the rank's open fds and threads after the first build and
after the last, for the test's bound on what a rebuild may keep. Weights and KV cache are
stand-ins: only the comm group is under test."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from services.worker import control
from services.worker.comm import CommGroup, configure_env
from shared.messages import SleepWorkerArgs, WakeupWorkerArgs


def held() -> tuple[int, int]:
    """This process's open fds and threads."""
    me = Path("/proc/self")
    return len(list((me / "fd").iterdir())), len(list((me / "task").iterdir()))


def model_all_reduce(model: SimpleNamespace, tp: int) -> float:
    """What the model's steps do on the TP group (``TPModel._all_reduce``)."""
    import paddle
    import paddle.distributed as dist

    x = paddle.ones([1], dtype="float32")
    dist.all_reduce(x, group=model.group)
    got = float(x.numpy()[0])
    assert got == tp, f"the model's group all-reduced ones to {got}"
    return got


def main() -> int:
    rank, tp, builds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
    configure_env(rank, tp, sys.argv[3].split(","))
    import paddle

    paddle.base.core.set_num_threads(1)  # tp ranks share the host's cores
    comm = CommGroup(rank, tp)
    comm.init()
    model = SimpleNamespace(group=comm.group)  # as TPModel gets it at the rank's start
    weights = SimpleNamespace(current=None, version="v0", nbytes=0, reload=lambda: None)
    kv = SimpleNamespace(allocated=True, nbytes=0)
    r = control.Rank(rank, tp, None, weights, kv, comm, "snapshot", model)  # type: ignore[arg-type]
    assert comm.check() == tp
    model_all_reduce(model, tp)
    fds0, threads0 = held()
    for i in range(builds):
        control.sleep(r, SleepWorkerArgs(["weight"], shutdown_comm_group=True))
        assert not comm.alive, f"sleep {i + 1} kept the comm group"
        at_once = i % 2 == 0 and i + 1 < builds  # the last group is checked
        if at_once and rank:
            time.sleep(0.3)  # rank 0 waits for the others in the build, as on a late wakeup
        control.wakeup(r, WakeupWorkerArgs(["weight"], "v0"))
        if at_once:
            continue  # the next sleep destroys the group at once, peers maybe still building
        got = comm.check()
        assert got == tp, f"build {i + 1}: all-reduce of ones gave {got}"
        assert model.group is comm.group, f"build {i + 1}: the model holds an older group"
        model_all_reduce(model, tp)
    fds, threads = held()
    print(f"rank {rank}: {builds + 1} TP groups built", flush=True)
    print(f"rank {rank}: fds {fds0} -> {fds}, threads {threads0} -> {threads}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # paddle's gloo threads may hold a normal exit


if __name__ == "__main__":
    sys.exit(main())
