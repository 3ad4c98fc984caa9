"""One rank for test_comm_groups.py: ``python comm_groups_rank.py RANK TP ENDPOINTS BUILDS``.

Joins the gloo group with :class:`CommGroup` (the TP group built once), then destroys and
builds the TP group ``BUILDS`` more times (as sleep / wakeup with
``SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE`` do), checking each group with an all-reduce.
Exit 0 when every group worked; a failed build raises (exit 1, the error on stderr)."""

from __future__ import annotations

import os
import sys

from services.worker.comm import CommGroup, configure_env


def main() -> int:
    rank, tp, builds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
    configure_env(rank, tp, sys.argv[3].split(","))
    import paddle

    paddle.base.core.set_num_threads(1)  # tp ranks share the host's cores
    comm = CommGroup(rank, tp)
    comm.init()
    assert comm.check() == tp
    for i in range(builds):
        comm.destroy()
        comm.build()
        got = comm.check()
        assert got == tp, f"build {i + 1}: all-reduce of ones gave {got}"
    print(f"rank {rank}: {builds + 1} TP groups built", flush=True)
    sys.stdout.flush()
    os._exit(0)  # paddle's gloo threads may hold a normal exit


if __name__ == "__main__":
    sys.exit(main())
