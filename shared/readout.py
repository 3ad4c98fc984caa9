"""Wire format of the read-only weights subjects: the served weights, rank by rank.

``rollbus.<i>.weights.get`` (every rank answers, queue group ``rank<r>``): each rank takes
a snapshot of its shard — one contiguous buffer of its tensors' raw bytes, C order, in
``tensors`` order — and answers with a :class:`ReadOpen` (JSON, in a ``WorkerReply``'s
``result``). ``rollbus.<i>.weights.<r>`` (rank ``r`` only): :class:`ChunkArgs` asks for
``chunk_bytes`` of that buffer from ``offset``; the answer is a msgpack :class:`Chunk`
(each reply fits the server's ``max_payload``). ``close`` drops the snapshot; an
abandoned one is dropped after :data:`IDLE_S` without a request. Pure: no nats, no paddle.
"""

from __future__ import annotations

import msgspec

IDLE_S = 30.0  # an open read with no chunk request this long is dropped
MAX_OPEN = 2  # open reads per rank (each holds one copy of the rank's shard)
DEFAULT_CHUNK = 512 * 1024
HEADROOM = 4096  # bytes of a reply's max_payload kept for the msgpack frame and headers


class ReadArgs(msgspec.Struct, forbid_unknown_fields=True):
    """``weights.get``: open a read; ``chunk_bytes`` 0 = the rank's default."""

    chunk_bytes: int = 0


class TensorEntry(msgspec.Struct):
    name: str  # inference (HF) name
    dtype: str  # numpy dtype name
    shape: list[int]
    offset: int  # in the snapshot buffer
    nbytes: int


class ReadOpen(msgspec.Struct):
    rank: int
    tp: int
    version: str
    read_id: str
    size: int
    sha256: str  # of the whole snapshot buffer
    chunk_bytes: int
    tensors: list[TensorEntry]


class ChunkArgs(msgspec.Struct, forbid_unknown_fields=True):
    read_id: str
    offset: int = 0
    close: bool = False


class Chunk(msgspec.Struct):
    offset: int = 0
    data: bytes = b""
    error_code: int = 200
    error_message: str = ""


def chunk_size(requested: int, max_payload: int) -> int:
    """Bytes per chunk: the request's (or the default), never past ``max_payload``."""
    limit = max(1024, max_payload - HEADROOM)
    return max(1024, min(requested or DEFAULT_CHUNK, limit))
