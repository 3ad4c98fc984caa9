"""Same-host shared-memory all-reduce of the CPU tensor-parallel ranks.

gloo's CPU all-reduce costs ~1 ms per call on loopback whatever the size (latency, not
bytes), and a decode step makes two per layer. When every rank runs on this host (the
launcher's ranks always do), they sum through shared memory instead:

* every rank owns one file ``rank<R>`` in a private directory (0700, files 0600) under
  ``/dev/shm``: a header (its sequence number and pid) and two slots of ``slot_bytes``.
  After every rank has mapped every file (two barriers on the gloo group) the files are
  unlinked: the mappings stay, nothing is left on disk even after a ``kill -9``.
* call ``k`` copies the rank's tensor to its slot ``k % 2``, publishes ``seq = k``, waits
  until every peer's ``seq >= k``, then sums the slots ``k % 2`` of ranks 0, 1, … in that
  order, so every rank adds the same operands in the same order: identical bits. A rank
  writes slot ``k % 2`` again only at call ``k + 2``, which needs every peer at ``k + 1``,
  i.e. done reading call ``k``: two slots are the second barrier.
* the wait spins briefly, then sleeps in short steps (releasing the GIL, so the rank's event
  loop keeps answering ``ping``/``status``); a peer whose process is gone, or that is not
  there within ``timeout_s`` (the rank's stuck-collective bound), raises an error naming it.

A tensor larger than a slot (sized from ``MAX_STEP_TOKENS × hidden``) or not float32 returns
``False`` from :meth:`ShmAllReduce.all_reduce`; the caller then uses gloo — every rank sees
the same shapes, so all take the same path.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
HEADER = 64  # bytes: seq (int64), pid (int64), padding to a cache line
SPIN_S = 200e-6  # spin (sched_yield: the GIL and the core stay free) this long, then sleep
SLEEP_S = 50e-6
PID_CHECK_S = 0.5  # how often a waiting rank checks that its peers' processes exist


class ShmReduceError(RuntimeError):
    pass


def default_root() -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")


def segment_dir(root: Path, key: str) -> Path:
    """The private directory of one rank set (``key``: e.g. its endpoint list)."""
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    return root / f"rollbus-tp-{os.getuid()}-{tag}"


def _private_dir(d: Path) -> None:
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ShmReduceError(f"{d} is not a private directory of this user (0700)")


class ShmAllReduce:
    def __init__(
        self,
        rank: int,
        tp: int,
        slot_bytes: int,
        directory: Path,
        barrier: Callable[[], None],
        timeout_s: float,
    ) -> None:
        if not 0 <= rank < tp or tp < 2:
            raise ValueError(f"rank {rank} / tp {tp}")
        self.rank, self.tp, self.timeout_s = rank, tp, timeout_s
        self.slot_bytes = -(-slot_bytes // 64) * 64
        self.dir = directory
        size = HEADER + 2 * self.slot_bytes
        _private_dir(directory)
        own = directory / f"rank{rank}"
        own.unlink(missing_ok=True)  # a stale file of a killed earlier rank set
        fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        barrier()  # every rank's file exists
        self._maps: list[mmap.mmap] = []
        try:
            for r in range(tp):
                fd = os.open(directory / f"rank{r}", os.O_RDWR)
                try:
                    if os.fstat(fd).st_size != size:
                        raise ShmReduceError(f"rank {r}'s segment has another size (settings?)")
                    self._maps.append(mmap.mmap(fd, size))
                finally:
                    os.close(fd)
        finally:
            barrier()  # every rank mapped every file: nothing needs the names any more
            own.unlink(missing_ok=True)
            try:
                directory.rmdir()
            except OSError:
                pass  # a peer's file is still there: the last one removes it
        self._head = [np.frombuffer(m, np.int64, 2, 0) for m in self._maps]
        sb = self.slot_bytes
        self._slots = [
            [np.frombuffer(m, np.uint8, sb, HEADER + i * sb) for i in (0, 1)] for m in self._maps
        ]
        self._pids = [0] * tp
        self._head[rank][1] = os.getpid()
        self._seq = int(self._head[rank][0])  # 0 for a new file
        self.closed = False

    def fits(self, nbytes: int) -> bool:
        return not self.closed and nbytes <= self.slot_bytes

    def reduce(self, a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Sum ``a`` (float32, contiguous) over all ranks; the result (``out`` or a new
        array) is bit-identical on every rank."""
        if self.closed:
            raise ShmReduceError("shared-memory all-reduce is closed")
        if a.dtype != np.float32 or a.nbytes > self.slot_bytes:
            raise ValueError(f"{a.dtype} {a.shape} does not fit a {self.slot_bytes}-byte slot")
        k = self._seq + 1
        parity = k % 2

        def slot(r: int) -> np.ndarray:
            return self._slots[r][parity][: a.nbytes].view(np.float32).reshape(a.shape)

        np.copyto(slot(self.rank), a)
        self._seq = k
        self._head[self.rank][0] = k  # after the data: x86 keeps stores in order
        self._wait(k)
        if out is None:
            out = np.empty_like(a)
        np.add(slot(0), slot(1), out=out)
        for r in range(2, self.tp):
            np.add(out, slot(r), out=out)
        return out

    def _wait(self, k: int) -> None:
        start = time.perf_counter()
        next_pid_check = start + PID_CHECK_S
        warned = False
        for r in range(self.tp):
            if r == self.rank:
                continue
            head = self._head[r]
            while True:
                s = int(head[0])
                if s >= k:
                    if s > k + 1:  # a peer can be at most one call ahead of us
                        raise ShmReduceError(
                            f"tensor-parallel all-reduce out of step: rank {r} is at call {s}, "
                            f"rank {self.rank} at {k}"
                        )
                    break
                now = time.perf_counter()
                if now - start < SPIN_S:
                    os.sched_yield()  # releases the GIL (~1 µs; time.sleep(0) costs ~60 µs)
                    continue
                if now >= next_pid_check:
                    next_pid_check = now + PID_CHECK_S
                    self._check_alive(r)
                if not warned and now - start > self.timeout_s / 2:
                    warned = True
                    log.warning("all-reduce call %d: waiting for rank %d", k, r)
                if now - start > self.timeout_s:
                    raise ShmReduceError(
                        f"tensor-parallel all-reduce: rank {r} did not arrive within "
                        f"{self.timeout_s:g}s (call {k})"
                    )
                time.sleep(SLEEP_S)

    def _check_alive(self, r: int) -> None:
        pid = int(self._head[r][1])
        if pid <= 0:
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise ShmReduceError(
                f"tensor-parallel all-reduce: rank {r} (pid {pid}) is gone"
            ) from None
        except PermissionError:
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._head = []
        self._slots = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a view: the mapping goes with the process
        self._maps = []
