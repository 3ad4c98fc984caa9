"""The read-only weights endpoint of a rank (``rollbus.<i>.weights.get`` / ``.weights.<r>``).

``open_read`` runs on the rank's paddle thread (so it never races a commit or a step):
it copies the rank's current tensors, by inference name, into one contiguous buffer and
hashes it. ``chunk`` then serves slices of that buffer from the event loop, no paddle
involved, so a read in progress does not hold up steps. At most :data:`MAX_OPEN` reads
are open per rank (each holds one copy of the shard); one idle for :data:`IDLE_S` is
dropped. The wire format is :mod:`shared.readout`.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from shared import messages as m
from shared import readout as ro
from shared.bus import Bus
from shared.errors import BAD_REQUEST, CONFLICT, INTERNAL, NOT_FOUND, ControlError
from shared.subjects import Subjects

log = logging.getLogger("rollbus.worker")


@dataclass
class _Read:
    buf: bytearray
    chunk: int  # bytes per chunk reply
    used: float = field(default_factory=time.monotonic)


class Reads:
    """The open reads of one rank."""

    def __init__(self, rank: int, tp: int, max_payload: int) -> None:
        self.rank, self.tp, self.max_payload = rank, tp, max_payload
        self.open: dict[str, _Read] = {}

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for rid, r in list(self.open.items()):
            if now - r.used > ro.IDLE_S:
                del self.open[rid]

    def open_read(
        self, version: str, tensors: dict[str, Any] | None, args: ro.ReadArgs
    ) -> dict[str, Any]:
        """Snapshot ``tensors`` (this rank's current weights: paddle tensors or arrays)."""
        if tensors is None:
            raise ControlError(CONFLICT, f"rank {self.rank}: weights are asleep")
        if args.chunk_bytes < 0:
            raise ControlError(BAD_REQUEST, "chunk_bytes must be >= 0")
        self.expire()
        if len(self.open) >= ro.MAX_OPEN:
            raise ControlError(
                CONFLICT,
                f"rank {self.rank}: {len(self.open)} weight reads open already "
                f"(each is dropped after {ro.IDLE_S:g}s idle); try again later",
            )
        arrays = {n: _host(t) for n, t in sorted(tensors.items())}
        entries, off = [], 0
        for n, a in arrays.items():
            entries.append(ro.TensorEntry(n, a.dtype.name, list(a.shape), off, a.nbytes))
            off += a.nbytes
        buf = bytearray(off)
        view = memoryview(buf)
        sha = hashlib.sha256()
        for e, a in zip(entries, arrays.values(), strict=True):
            part = view[e.offset : e.offset + e.nbytes]
            np.copyto(np.frombuffer(part, a.dtype).reshape(a.shape), a)
            sha.update(part)
        rid = uuid.uuid4().hex
        size = ro.chunk_size(args.chunk_bytes, self.max_payload)
        self.open[rid] = _Read(buf, size)
        opened = ro.ReadOpen(
            rank=self.rank,
            tp=self.tp,
            version=version,
            read_id=rid,
            size=off,
            sha256=sha.hexdigest(),
            chunk_bytes=size,
            tensors=entries,
        )
        return dict(msgspec.to_builtins(opened))

    def chunk(self, args: ro.ChunkArgs) -> ro.Chunk:
        self.expire()
        r = self.open.get(args.read_id)
        if r is None:
            return ro.Chunk(
                error_code=NOT_FOUND,
                error_message=f"rank {self.rank}: no open weight read {args.read_id[:12]!r} "
                f"(closed, or idle for more than {ro.IDLE_S:g}s)",
            )
        if args.close:
            del self.open[args.read_id]
            return ro.Chunk(offset=len(r.buf))
        if not 0 <= args.offset <= len(r.buf):
            msg = f"offset {args.offset} out of range"
            return ro.Chunk(error_code=BAD_REQUEST, error_message=msg)
        r.used = time.monotonic()
        end = args.offset + r.chunk
        return ro.Chunk(offset=args.offset, data=bytes(memoryview(r.buf)[args.offset : end]))


def _host(t: Any) -> np.ndarray:
    """A tensor as a C-contiguous numpy array (a copy for paddle tensors); dtypes numpy
    lacks (bfloat16) as float32."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t)
    dt = str(getattr(t, "dtype", ""))
    if "bfloat16" in dt:
        t = t.astype("float32")
    return np.ascontiguousarray(t.numpy())


async def serve(
    bus: Bus,
    svc: Any,
    subjects: Subjects,
    reads: Reads,
    open_read: Callable[[ro.ReadArgs], Awaitable[dict[str, Any]]],
    reply_headers: dict[str, str],
) -> None:
    """Answer ``weights.get`` (a ``WorkerReply`` whose result is a ``ReadOpen``; queue
    group ``rank<r>``: every rank answers) and ``weights.<r>`` (msgpack ``Chunk``s)."""
    rank = reads.rank

    async def on_open(data: bytes, headers: dict[str, str]) -> bytes:
        try:
            result = await open_read(m.decode_args(data, ro.ReadArgs))
            return m.json_encode(m.WorkerReply(rank, result=result))
        except ControlError as e:
            return m.json_encode(m.WorkerReply(rank, e.code, e.message, e.result or {}))
        except Exception as e:  # a bug must reach the caller, not vanish
            log.exception("rank %d: weights.get failed", rank)
            return m.json_encode(m.WorkerReply(rank, INTERNAL, f"rank {rank}: {e!r}"))

    async def on_chunk(data: bytes, headers: dict[str, str]) -> bytes:
        try:
            args = m.decode_args(data, ro.ChunkArgs)
        except ControlError as e:
            return m.pack(ro.Chunk(error_code=e.code, error_message=e.message))
        return m.pack(reads.chunk(args))

    q = f"rank{rank}"
    await bus.serve(
        svc, "weights_get", subjects.weights_get, on_open, queue=q, reply_headers=reply_headers
    )
    await bus.serve(
        svc, "weights_chunk", subjects.weights_rank(rank), on_chunk,
        queue=q, reply_headers=reply_headers, concurrent=True,
    )
