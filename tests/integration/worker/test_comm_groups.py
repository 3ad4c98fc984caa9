"""Building a TP group never reads another group's rendezvous addresses.

paddle's gloo process group publishes its pair addresses on the store it is given under
the bare keys ``"0"`` … ``"tp-1"``: the same keys for every group. On paddle's default
store a rank that looked a peer up before the peer had written its new address got the
previous group's (closed) one: ``connect …: Connection refused``, or ``TIMEOUT``. That
broke TP=4 rank starts under load (the first TP group follows the global group) and every
rebuild after ``sleep`` with ``SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE``.
:meth:`CommGroup.build` gives each group a store of its own. Four real rank processes
build the TP group several times; with groups on the default store this failed at the
first or second rebuild in every run here (README "Tensor parallelism").

A destroyed group is released too (:func:`services.worker.comm.release`): paddle kept
every gloo group it built, so each rebuild kept its sockets and threads — here 20 fds and
3 threads on rank 0, 9 fds and 2 threads on the others. What a rebuild still keeps is
paddle's comm context of the group, which nothing can erase: one epoll fd plus ``TP - 1``
sockets, and one thread (README "Limit: comm-group rebuilds").

Every other group is destroyed as soon as its rank has built it, the other ranks 0.3 s late
into the build: a rank that left the build first and destroyed the group closed the pairs
a slower peer was still connecting, whose build then failed with gloo's ``TIMEOUT
self_rank = …`` (a late wakeup, then the sleep queued behind it: CI, session 13). Now no
rank leaves the build before all are done with it (a barrier on the global group)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from services.worker.ports import rendezvous_port
from tests.rankprocs import rank_processes, wait_ok

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
HELPER = HERE / "comm_groups_rank.py"
TP, REBUILDS = 4, 8
TIMEOUT_S = 240.0  # four paddle imports on a shared 2-core host, then the builds


def test_tp_groups_build_again_and_again(tmp_path: Path) -> None:
    ports: list[int] = []
    while len(ports) < TP:
        if (p := rendezvous_port()) not in ports:
            ports.append(p)
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "GLOG_minloglevel": "2",
    }
    logs = [tmp_path / f"rank{r}.log" for r in range(TP)]
    deadline = time.monotonic() + TIMEOUT_S
    runs = [
        ([sys.executable, str(HELPER), str(r), str(TP), endpoints, str(REBUILDS)], env, logs[r])
        for r in range(TP)
    ]
    with rank_processes(runs, ROOT) as procs:
        for r, tail in enumerate(wait_ok(procs, logs, deadline, tail=2000)):
            assert f"{REBUILDS + 1} TP groups built" in tail
            held = re.search(r"fds (\d+) -> (\d+), threads (\d+) -> (\d+)", tail)
            assert held, tail
            fds0, fds, threads0, threads = map(int, held.groups())
            # per rebuild: what paddle's comm context keeps (TP fds, one thread); +4 and
            # +1 of slack for a socket or thread on its way out
            assert fds - fds0 <= REBUILDS * TP + 4, f"rank {r}: {held.group(0)}"
            assert threads - threads0 <= REBUILDS + 1, f"rank {r}: {held.group(0)}"
