"""The tensor-parallel communication group of the worker ranks (``paddle.distributed``).

We start the ranks ourselves (no ``paddle.distributed.launch``): the launcher hands each
rank its endpoint list, ``init_parallel_env`` joins the global gloo (CPU) or NCCL (GPU)
group once (the device choice is :mod:`shared.device`; :func:`place` applies it), and
tensor parallelism runs on a sub-group created with ``new_group`` so it
can be destroyed on sleep (``SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE``) and rebuilt on
wakeup without restarting the process. Creating or destroying a group is collective:
every rank must call it, which the engine's scatter guarantees.

Every TP group is rendezvoused on a TCP store of its own (:meth:`CommGroup.build`), never
on paddle's default store: paddle's gloo process group publishes its pair addresses there
under the bare keys ``"0"`` … ``"tp-1"``, the same keys for every group, so a rank that
looked a peer up before that peer had written its new address got the previous group's
(whose listeners are closed) and failed with ``connect …: Connection refused`` or waited
for a connection that never came (``TIMEOUT``): under load, TP=4 rank starts failed so
(session 10's bench: a TP=4 stack not healthy in 120 s, three attempts in a row).

Destroying a gloo group takes more than ``destroy_process_group``, which only forgets the
group in ``_GroupManager``: paddle's ``collective`` module keeps it in three more maps, and
its C++ side keeps every process group it created in ``ProcessGroupIdMap`` (keyed by gid,
released only by ``core.ProcessGroupIdMap.destroy()``, which paddle calls at exit). Each
kept group holds its full mesh of sockets, the gloo device's thread and its store, so every
rebuild added 14 fds and 3 threads on rank 0 (2 ranks). :func:`release` drops all of those
references. What stays is paddle's second mesh of the group, the ``GlooCommContext``
``CommContextManager`` creates with it (keyed by gid; paddle offers no way to erase it):
one epoll fd, ``tp - 1`` sockets and one thread a rebuild (README "Limit: comm-group
rebuilds").
"""

from __future__ import annotations

import os
from typing import Any

from services.worker.ports import rendezvous_port
from services.worker.shmreduce import ShmAllReduce, default_root, segment_dir
from shared.device import DeviceError, comm_env, gpu_problem, paddle_device

# the key of the default store under which rank 0 publishes a TP group's store port
GROUP_STORE_KEY = "rollbus/tp-group-store/{n}"


def place(device: str, rank: int, tp: int) -> str:
    """Check that this paddle build can serve ``device`` for ``tp`` ranks, then make it
    the rank's default device (``cpu`` or ``gpu:<rank>``); :class:`DeviceError` (one line)
    when it cannot. Every tensor the rank creates afterwards lives there."""
    import paddle

    cuda = bool(paddle.device.is_compiled_with_cuda())
    count = int(paddle.device.cuda.device_count()) if cuda else 0
    if problem := gpu_problem(device, tp, cuda, count):
        raise DeviceError(problem)
    where = paddle_device(device, rank)
    paddle.set_device(where)
    return where


def configure_env(rank: int, tp: int, endpoints: list[str], device: str = "cpu") -> None:
    os.environ.update(
        PADDLE_TRAINER_ID=str(rank),
        PADDLE_TRAINERS_NUM=str(tp),
        PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
        PADDLE_CURRENT_ENDPOINT=endpoints[rank],
        **comm_env(device, rank),  # gloo, or NCCL on gpu:<rank>
    )
    # gloo's pair sockets follow this interface; keep them on loopback for a
    # single-host deployment (override it for multi-host ranks)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def local_endpoints(endpoints: list[str]) -> bool:
    """Every endpoint is on this host (loopback): the ranks can share memory."""
    hosts = [e.rsplit(":", 1)[0].strip("[]") for e in endpoints]
    return bool(hosts) and all(h in ("localhost", "::1") or h.startswith("127.") for h in hosts)


class CommGroup:
    def __init__(
        self, rank: int, tp: int, shm_bytes: int = 0, shm_timeout_s: float = 600.0
    ) -> None:
        """``shm_bytes`` > 0: after joining, also map a same-host shared-memory all-reduce
        (:mod:`services.worker.shmreduce`) with slots of that size."""
        self.rank, self.tp = rank, tp
        self.group: Any = None
        self._initialized = False
        self.shm_bytes, self.shm_timeout_s = shm_bytes, shm_timeout_s
        self.shm: ShmAllReduce | None = None
        self.builds = 0  # TP groups built so far (the same count on every rank)
        # the current gloo TP group's own store (paddle's group holds it too)
        self.store: Any = None

    @property
    def alive(self) -> bool:
        return self.tp == 1 or self.group is not None

    def init(self) -> None:
        """Join the global group (once per process), then build the TP group."""
        if self.tp == 1:
            return
        import paddle.distributed as dist

        if not self._initialized:
            dist.init_parallel_env()
            self._initialized = True
        self.build()
        if self.shm_bytes > 0 and self.shm is None:
            key = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "")  # unique per live rank set
            self.shm = ShmAllReduce(
                self.rank,
                self.tp,
                self.shm_bytes,
                segment_dir(default_root(), key),
                dist.barrier,
                self.shm_timeout_s,
            )

    def build(self) -> None:
        if self.tp == 1 or self.group is not None:
            return
        import paddle.distributed as dist
        from paddle.distributed import collective

        dist.barrier()  # on the global group: every rank is here before the full-mesh connect
        if os.environ.get("PADDLE_DISTRI_BACKEND") != "gloo":
            # NCCL's rendezvous keys name their group: no stale address to read
            self.group = dist.new_group(list(range(self.tp)))
        else:
            default = collective._default_store
            store = self._group_store(default)
            # new_group rendezvouses on paddle's default store: ours for this one call
            collective._default_store = store
            try:
                self.group = dist.new_group(list(range(self.tp)))
            finally:
                collective._default_store = default
        # and every rank is done with the connect before any leaves: a rank that went on
        # and destroyed the new group at once (a sleep queued behind this wakeup) closed
        # pairs a slower peer was still connecting, which then failed with gloo's
        # ``TIMEOUT self_rank = …``. The global group's barrier, not the new group's: a
        # rank may leave a barrier before its peer has, and the global group is never
        # destroyed under it.
        dist.barrier()

    def _group_store(self, default: Any) -> Any:
        """A new TCP store for the next TP group, hosted by rank 0 on a fresh port that
        rank 0 publishes on the default store under a key of this build alone (so no rank
        ever reads an earlier group's value there either). Its pair-address keys are
        empty until each rank writes its own: a peer's lookup waits for the new address."""
        from paddle.base import core

        n, self.builds = self.builds, self.builds + 1
        key = GROUP_STORE_KEY.format(n=n)
        host = os.environ["PADDLE_TRAINER_ENDPOINTS"].split(",")[0].rsplit(":", 1)[0].strip("[]")
        timeout = int(os.environ.get("FLAGS_stop_check_timeout", "900"))
        if self.rank == 0:
            port = rendezvous_port(host)
            default.set(key, str(port))
        else:
            port = int(bytes(default.get(key)).decode())
        # rank 0 serves it; every rank (rank 0 too) connects, and the constructor returns
        # once all ``tp`` have
        store = core.TCPStore(host, port, self.rank == 0, self.tp, timeout)
        self.store = store
        return store

    def destroy(self) -> None:
        if self.tp == 1 or self.group is None:
            return
        import paddle.distributed as dist

        group, self.group = self.group, None
        dist.destroy_process_group(group)
        if os.environ.get("PADDLE_DISTRI_BACKEND") == "gloo":
            # NCCL keeps its old path: unmeasured here (no GPU), README says so
            self.store = None
            release(group)

    def check(self) -> float:
        """All-reduce a 1 from every rank: returns ``tp`` when the group works."""
        if self.tp == 1:
            return 1.0
        if self.group is None:
            raise RuntimeError("communication group is shut down")
        import paddle
        import paddle.distributed as dist

        x = paddle.ones([1], dtype="float32")
        dist.all_reduce(x, group=self.group)
        return float(x.numpy()[0])


def release(group: Any) -> None:
    """Drop paddle's references to a group ``destroy_process_group`` destroyed, so that its
    process group (sockets, device thread, store) is freed once the caller drops its own.

    ``ProcessGroupIdMap.destroy()`` drops paddle's C++ reference to *every* process group;
    those still in use (the global group, a live TP group) are held by their Python
    ``Group`` too and live on: only a group nobody else holds is freed.

    paddle's legacy ``ProcessGroupMapFromGid`` keeps a raw pointer to every group by gid
    and never erases it: once freed, a legacy static-graph op addressed by the destroyed
    group's ring id (``c_allreduce_*``, ``mp_allreduce_sum``) would read freed memory.
    rollbus runs none: its collectives go through the live ``Group``'s process group
    (``dist.all_reduce``/``barrier``), and gids are never reused."""
    from paddle.base import core
    from paddle.distributed import collective

    if collective._group_map.get(group.id) is group:
        del collective._group_map[group.id]
    if collective._group_map_by_name.get(group.name) is group:
        del collective._group_map_by_name[group.name]
    collective._group_map_backend.pop(group, None)
    core.ProcessGroupIdMap.destroy()
