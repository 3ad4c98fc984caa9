"""Control methods of one rank, as plain functions of the rank's state.

Each takes the :class:`Rank` and the decoded arguments and returns a result dict or
raises ``ControlError``. They run on the rank's single paddle thread (see
``services.worker.main``), so they never race a model step or each other.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.worker import model as mdl
from services.worker.comm import CommGroup
from services.worker.weights import WeightStore, digest
from shared import procs
from shared.errors import CONFLICT, UNAVAILABLE, ControlError
from shared.messages import (
    CommitArgs,
    SelfBenchArgs,
    SleepWorkerArgs,
    StageArgs,
    UpdateIdArgs,
    WakeupWorkerArgs,
)
from shared.model_config import ModelConfig

log = logging.getLogger("rollbus.worker")


def release_memory() -> None:
    """Hand freed heap pages back to the OS.

    Paddle's CPU tensors come from glibc malloc; after numpy temporaries raised glibc's
    dynamic mmap threshold, big buffers live in the heap and ``free`` keeps them mapped.
    ``malloc_trim(0)`` returns every free page, so sleep shows up in RSS at once.
    """
    gc.collect()
    mdl.release_heap()  # malloc_trim(0), and the heap top model.py keeps for steps


_PAGE = os.sysconf("SC_PAGE_SIZE")
_statm: tuple[int, int] | None = None  # (pid, fd of its /proc/self/statm), kept open


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``, read afresh on
    every call through an fd kept open: one pread(2), not open/read/close — ``status``
    reports it on every call)."""
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:  # first call, or a forked child
        _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
    return int(os.pread(_statm[1], 256, 0).split()[1]) * _PAGE


@dataclass
class Rank:
    rank: int
    tp: int
    cfg: ModelConfig
    weights: WeightStore
    kv: mdl.KVCache
    comm: CommGroup
    strategy: str
    model: mdl.TPModel | None = None
    started: float = field(default_factory=time.time)
    # monotonic time the compute thread entered the comm group's rebuild (collective: a
    # peer that never comes blocks it for good; the step watchdog ends such a process)
    collective_since: float | None = None

    def status(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "pid_space": procs.pid_space(),  # the engine sees this pid exit when it shares it
            "version": self.weights.version,
            "weights_loaded": self.weights.current is not None,
            "weight_bytes": self.weights.nbytes,
            "kv_allocated": self.kv.allocated,
            "kv_bytes": self.kv.nbytes if self.kv.allocated else 0,
            "comm_group": self.comm.alive,
            "rss_bytes": rss_bytes(),
            "strategy": self.strategy,
        }


Late = Callable[[], str]  # why the call's caller gave up on it by now ("" while it waits)


def in_time() -> str:
    return ""


def not_late(r: Rank, method: str, late: Late) -> None:
    """Refuse to go on with ``method`` once its caller (the engine) gave up on it: a rank
    that was stopped, or whose connection dropped, runs it after the engine told its own
    caller it failed and undid it on the other ranks (README Bus contract)."""
    if why := late():
        log.warning("rank %d: %s not run: %s", r.rank, method, why)
        raise ControlError(UNAVAILABLE, f"rank {r.rank}: {method} not run: {why}")


def ping(r: Rank, _: object = None) -> dict[str, Any]:
    return {"rank": r.rank, "version": r.weights.version, "pid": os.getpid()}


def status(r: Rank, _: object = None) -> dict[str, Any]:
    return r.status()


def stage(r: Rank, args: StageArgs, late: Late = in_time) -> dict[str, Any]:
    """Weights asleep: the version is validated and freed again (``loaded: false``); its
    commit only records it as current, and wakeup loads it."""
    not_late(r, "stage", late)
    out = r.weights.stage(args.version, args.verify_checksum, args.update_id)
    if r.weights.current is None:
        release_memory()
    return {"rank": r.rank, **out}


def commit(r: Rank, args: CommitArgs, late: Late = in_time) -> dict[str, Any]:
    # checked here, on the paddle thread, after the bus barrier: the last moment before
    # the swap (a late commit whose rollback never arrived must not switch this rank)
    not_late(r, "commit", late)
    r.weights.commit(args.version, args.update_id)
    return {"rank": r.rank, "version": r.weights.version}


def finalize(r: Rank, args: UpdateIdArgs) -> dict[str, Any]:
    r.weights.finalize(args.update_id)
    release_memory()
    return {"rank": r.rank, "version": r.weights.version}


def rollback(r: Rank, args: UpdateIdArgs) -> dict[str, Any]:
    rolled = r.weights.rollback(args.update_id)
    release_memory()
    return {"rank": r.rank, "version": r.weights.version, "rolled_back": rolled}


def abort(r: Rank, _: object = None) -> dict[str, Any]:
    r.weights.abort()
    release_memory()
    return {"rank": r.rank, "version": r.weights.version}


def sleep(r: Rank, args: SleepWorkerArgs) -> dict[str, Any]:
    before = rss_bytes()
    freed = 0
    if "weight" in args.tags and r.weights.current is not None:
        freed += r.weights.nbytes
        r.weights.free()
    if "kv_cache" in args.tags and r.kv.allocated:
        freed += r.kv.nbytes
        r.kv.free()
    if args.shutdown_comm_group and "weight" in args.tags:
        r.comm.destroy()
        follow_group(r)
    release_memory()
    return {"rank": r.rank, "freed_bytes": freed, "rss_before": before, "rss_after": rss_bytes()}


def follow_group(r: Rank) -> None:
    """The model all-reduces on the TP group the rank has now: holding the first one, it
    kept every destroyed group's sockets (and, on a GPU, its NCCL memory) alive."""
    if r.model is not None:
        r.model.group = r.comm.group


def wakeup(r: Rank, args: WakeupWorkerArgs, late: Late = in_time) -> dict[str, Any]:
    """Rebuild what sleep freed: comm group, KV cache, then the *current* version.

    Once its caller gave up (``late``) the KV cache and weights are not brought back (the
    engine stays asleep): memory the operator freed stays free. The comm group is rebuilt
    even then: building it is collective, and a peer that got this wakeup in time waits
    for this rank inside it; every rank runs the same collectives in the same order."""
    before = rss_bytes()
    t0 = time.perf_counter()
    if not r.comm.alive:
        r.collective_since = time.monotonic()
    try:
        r.comm.build()
    finally:
        r.collective_since = None
    follow_group(r)
    not_late(r, "wakeup", late)
    if "kv_cache" in args.tags and not r.kv.allocated:
        r.kv.allocate()
    if "weight" in args.tags and r.weights.current is None:
        r.weights.reload()
    return {
        "rank": r.rank,
        "version": r.weights.version,
        "rss_before": before,
        "rss_after": rss_bytes(),
        "seconds": time.perf_counter() - t0,
    }


def weights_digest(r: Rank, _: object = None) -> dict[str, Any]:
    if r.weights.current is None:
        raise ControlError(CONFLICT, f"rank {r.rank}: weights are asleep")
    return {"rank": r.rank, "version": r.weights.version, "sha256": digest(r.weights.current)}


def comm_check(r: Rank, _: object = None) -> dict[str, Any]:
    try:
        total = r.comm.check()
    except RuntimeError as e:
        raise ControlError(CONFLICT, f"rank {r.rank}: {e}") from None
    return {"rank": r.rank, "all_reduce": total}


def selfbench(r: Rank, args: SelfBenchArgs) -> dict[str, Any]:
    """Greedy-decode ``batch`` sequences for ``steps`` steps on the ranks alone.

    The same forward, KV cache and rank-0 argmax as an engine step, minus the bus: the
    baseline the generation benchmark compares its throughput with. Needs an idle rank
    (it writes into the KV cache from block 0), which the benchmark guarantees.
    """
    import numpy as np

    if r.model is None or r.weights.current is None or not r.kv.allocated:
        raise ControlError(CONFLICT, f"rank {r.rank}: asleep")
    bs = r.kv.block_size
    per_seq = -(-(args.prompt_len + args.steps) // bs)
    if per_seq * args.batch > r.kv.num_blocks:
        raise ControlError(400, f"selfbench needs {per_seq * args.batch} KV blocks")
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.batch)]
    prompts = [
        [(7 * i + j) % r.cfg.vocab_size for j in range(args.prompt_len)] for i in range(args.batch)
    ]
    w = r.weights.current
    t0 = time.perf_counter()
    logits = r.model.forward(w, r.kv, mdl.Batch(prompts, [0] * args.batch, tables))
    last = [int(t) for t in np.argmax(logits.numpy(), axis=-1)]
    prefill_s = time.perf_counter() - t0
    # with ``prefill`` the prompts' step counts and yields the first token (as over HTTP)
    if not args.prefill:
        t0 = time.perf_counter()
    for step in range(args.steps - (1 if args.prefill else 0)):
        pos = [args.prompt_len + step] * args.batch
        logits = r.model.forward(w, r.kv, mdl.Batch([[t] for t in last], pos, tables))
        # every rank takes the argmax so all feed identical tokens (engine steps do too)
        last = [int(t) for t in np.argmax(logits.numpy(), axis=-1)]
    dt = time.perf_counter() - t0
    return {
        "rank": r.rank,
        "tokens_per_s": args.batch * args.steps / dt,
        "step_ms": dt / args.steps * 1e3,
        "prefill_ms": prefill_s * 1e3,
    }
