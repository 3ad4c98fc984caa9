"""The rollout side's ``state_dict()`` as a trainer sees it: the served weights by
inference (HF) name, each gathered across the TP ranks into one full tensor.

::

    from services.trainer import rollout_state_dict

    state = rollout_state_dict("nats://127.0.0.1:4222")      # {HF name: np.ndarray}
    state.version                                             # the version they are
    names.to_training(state, cfg)                             # the trainer's names/layout

It reads the ranks over the read-only subjects of :mod:`shared.readout` (the trainer and
operator roles may use them; ``worker.ctl`` stays the engine's): ``rollbus.<i>.weights.get``
makes every rank snapshot its shard and describe it, then each rank's buffer comes in
chunks from ``rollbus.<i>.weights.<r>`` (``WINDOW`` requests in flight per rank, each
reply within the server's ``max_payload``), checked against the rank's SHA-256. The
shards are joined by the model's own sharding rules (``shared.sharding``: column
splits on axis 0, row splits on axis 1, replicated tensors — which must be equal on every
rank, as must the copies of a kv head held by several ranks). Every rank must serve the
same version, else the read fails (409: an update in progress) and nothing is returned.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import msgspec
import numpy as np

from shared import readout as ro
from shared import sharding
from shared.bus import Bus
from shared.creds import default_dir, role_url
from shared.errors import CONFLICT, UNAVAILABLE, UNPROCESSABLE, ControlError
from shared.messages import ControlReply, WorkerReply, json_decode, unpack
from shared.model_config import ModelConfig
from shared.subjects import Subjects

WINDOW = 8  # chunk requests in flight per rank


class RolloutState(dict[str, np.ndarray]):
    """``{inference name: full tensor}`` plus the ``version`` the ranks serve."""

    version: str = ""
    tp: int = 0


async def _served(bus: Bus, subjects: Subjects, timeout: float) -> dict[str, Any]:
    rep = await bus.request(subjects.ctl("model_config"), b"{}", timeout=timeout)
    reply = json_decode(rep.data, type=ControlReply)
    if reply.error_code != 200 or not reply.result:
        raise ControlError(reply.error_code, f"model_config: {reply.error_message}")
    return dict(reply.result)


async def _fetch(bus: Bus, subjects: Subjects, opened: ro.ReadOpen, timeout: float) -> bytearray:
    buf = bytearray(opened.size)
    sem = asyncio.Semaphore(WINDOW)
    subject = subjects.weights_rank(opened.rank)

    async def one(off: int) -> None:
        async with sem:
            body = msgspec.json.encode(ro.ChunkArgs(opened.read_id, off))
            rep = await bus.request(subject, body, timeout=timeout)
        c = unpack(rep.data, type=ro.Chunk)
        if c.error_code != 200:
            raise ControlError(c.error_code, c.error_message)
        want = min(opened.chunk_bytes, opened.size - off)
        if c.offset != off or len(c.data) != want:
            raise ControlError(
                UNPROCESSABLE,
                f"rank {opened.rank}: chunk at {off} has {len(c.data)} bytes, expected {want}",
            )
        buf[off : off + want] = c.data

    await asyncio.gather(*(one(o) for o in range(0, opened.size, opened.chunk_bytes)))
    if hashlib.sha256(buf).hexdigest() != opened.sha256:
        raise ControlError(UNPROCESSABLE, f"rank {opened.rank}: weights read SHA-256 mismatch")
    return buf


async def _close(bus: Bus, subjects: Subjects, opened: list[ro.ReadOpen]) -> None:
    for o in opened:  # best effort: an unclosed read is dropped after IDLE_S anyway
        body = msgspec.json.encode(ro.ChunkArgs(o.read_id, close=True))
        try:
            await bus.request(subjects.weights_rank(o.rank), body, timeout=5)
        except Exception:  # noqa: BLE001
            pass


def _arrays(opened: ro.ReadOpen, buf: bytearray) -> dict[str, np.ndarray]:
    out = {}
    for e in opened.tensors:
        dt = np.dtype(e.dtype)
        a = np.frombuffer(buf, dt, e.nbytes // dt.itemsize, e.offset)
        out[e.name] = a.reshape(e.shape)
    return out


def gather_shards(cfg: ModelConfig, shards: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Full tensors from every rank's shard (rank order), by the model's sharding rules:
    the inverse of :func:`shared.sharding.shard_tensor`. Raises ``ValueError`` on
    missing or extra tensors, wrong shapes, or copies that differ between ranks."""
    tp = len(shards)
    full = sharding.full_shapes(cfg)
    for r, shard in enumerate(shards):
        if set(shard) != set(full):
            extra, missing = sorted(set(shard) - set(full)), sorted(set(full) - set(shard))
            raise ValueError(
                f"rank {r}: tensors differ from the config: +{extra[:3]} -{missing[:3]}"
            )
    out: dict[str, np.ndarray] = {}
    for name, shape in full.items():
        axis = sharding.split_axis(name)
        for r, shard in enumerate(shards):
            want = sharding.shard_shape(cfg, name, shape, r, tp)
            if tuple(shard[name].shape) != want:
                raise ValueError(f"rank {r}: {name} has shape {shard[name].shape}, want {want}")
        if axis is None:
            a = shards[0][name]
            for r in range(1, tp):
                if not np.array_equal(shards[r][name], a):
                    raise ValueError(f"{name}: replicated tensor differs on rank {r}")
            out[name] = np.array(a)
            continue
        t = np.empty(shape, shards[0][name].dtype)
        filled: dict[int, int] = {}  # start -> rank that wrote it
        for r, shard in enumerate(shards):
            part = sharding.shard_part(cfg, name, shape, r, tp)
            assert part is not None  # a split tensor
            _, start, size = part
            index = [slice(None)] * len(shape)
            index[axis] = slice(start, start + size)
            if start in filled:  # a kv head several ranks hold a copy of
                if not np.array_equal(t[tuple(index)], shard[name]):
                    raise ValueError(f"{name}: the copies on ranks {filled[start]} and {r} differ")
                continue
            t[tuple(index)] = shard[name]
            filled[start] = r
        out[name] = t
    return out


async def arollout_state_dict(
    nats_url: str,
    instance: str = "default",
    *,
    timeout: float = 60.0,
    chunk_bytes: int = 0,
) -> RolloutState:
    """See :func:`rollout_state_dict`."""
    subjects = Subjects(instance)
    bus = await Bus.connect(role_url(nats_url, "trainer", default_dir()), "rollbus-state-dict")
    opened: list[ro.ReadOpen] = []
    try:
        served = await _served(bus, subjects, timeout)
        tp = int(served["tp"])
        cfg = ModelConfig.from_hf(dict(served["config"]))
        body = msgspec.json.encode(ro.ReadArgs(chunk_bytes))
        try:
            reps = await bus.scatter(subjects.weights_get, body, expected=tp, timeout=timeout)
        except ControlError as e:  # a Timeout naming the ranks that did not answer
            got = (e.result or {}).get("replies", {})
            opened = _opened(got)
            raise ControlError(UNAVAILABLE, e.message) from None
        opened = _opened(reps)
        errors = [json_decode(rep.data, type=WorkerReply) for rep in reps.values()]
        bad = [w for w in errors if w.error_code != 200]
        if bad:
            raise ControlError(bad[0].error_code, "; ".join(w.error_message for w in bad))
        versions = {o.rank: o.version for o in opened}
        if len(set(versions.values())) != 1:
            raise ControlError(
                CONFLICT, f"ranks serve different versions {versions} (an update in progress?)"
            )
        bufs = await asyncio.gather(*(_fetch(bus, subjects, o, timeout) for o in opened))
        state = RolloutState(
            gather_shards(cfg, [_arrays(o, b) for o, b in zip(opened, bufs, strict=True)])
        )
        state.version, state.tp = opened[0].version, tp
        return state
    finally:
        if opened:
            await _close(bus, subjects, opened)
        await bus.close()


def _opened(reps: dict[int, Any]) -> list[ro.ReadOpen]:
    out = []
    for _, rep in sorted(reps.items()):
        w = json_decode(rep.data, type=WorkerReply)
        if w.error_code == 200:
            out.append(msgspec.convert(w.result, ro.ReadOpen))
    return out


def rollout_state_dict(
    nats_url: str,
    instance: str = "default",
    *,
    timeout: float = 60.0,
    chunk_bytes: int = 0,
) -> RolloutState:
    """The served weights of ``instance``: ``{inference name: full np.ndarray}`` (HF names
    and layout, gathered across TP), with ``.version``. The trainer's credentials are
    added from ``DATA_DIR/creds`` when ``nats_url`` carries none. Raises
    :class:`~shared.errors.ControlError` (409 weights asleep / ranks on different
    versions, 503 a rank not answering, 422 a corrupt read)."""
    return asyncio.run(
        arollout_state_dict(nats_url, instance, timeout=timeout, chunk_bytes=chunk_bytes)
    )
