"""Checkpoint storage on NATS: object-store I/O at wire speed and the version stream.

With :mod:`shared.bus`, the only module that touches nats-py. Objects use the standard
NATS object-store layout (stream ``OBJ_<bucket>``, meta ``$O.<bucket>.M.<b64(name)>``,
chunks ``$O.<bucket>.C.<nuid>``), so the ``nats`` CLI and stock clients read what we
write and we read what they write.

Why our own reader (:func:`read_object`): nats-py's ``ObjectStore.get`` answers the
server's flow-control requests from a 250 ms poll (~57 MiB/s) and concatenates chunks
quadratically. Ours creates no consumer at all (a role that may create a push consumer
can have stored messages delivered to any subject: only the engine may): it reads the
object's chunk subject with batched direct gets (``$JS.API.DIRECT.GET``,
``next_by_subj``, ``READ_BATCH`` chunks per request, the next asked when a batch's end
marker arrives), so at most ``READ_BATCH`` MiB are in flight (far under the 64 MiB at
which the server silently drops a slow client). Chunks are
copied straight into one preallocated private anonymous mmap of the object's size
(pages faulted in ahead of the writer on a helper thread, unmapped when freed). The
SHA-256, when asked, is computed on a helper thread as the chunks land, in place
(``hashlib`` releases the GIL for large buffers): it costs CPU (≈ 1 s per GiB here),
little wall time.
Every chunk's stream sequence must grow and the chunk count and size must match the
meta: a stall or a disconnect fails the read (:class:`ObjectReadError`); a lost chunk, a
size or digest mismatch raises :class:`ObjectCorrupt`. Nothing partial is ever returned.
A large object is read over a connection of the reader's own (:mod:`shared._fastwire`:
frames parsed there, payloads received by the kernel straight into the buffer; the
next batch asked when a batch's last chunk starts arriving); nats-py is the fallback.

Our writer (:func:`put_object`) pipelines chunk publishes with a bounded window of
outstanding JetStream acks (nats-py's ``put`` waits for each ack in turn) and writes
the meta message last, so a reader never sees a half-written object. A large object's
chunks go over a plain-TCP connection of the writer's own, straight from the caller's
buffer to the kernel (:class:`shared._fastwire.Link`).

Version stream: ``ROLLBUS_CKPT`` holds ``rollbus.ckpt.<model>.published`` events,
deduplicated by ``Nats-Msg-Id = <model>/<version>``; the JetStream stream sequence of
an event is the version's place in publish order. The audit-log stream
``ROLLBUS_EVENTS`` is configured here too (:func:`ensure_events_stream`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import APIError, BadRequestError, NotFoundError

from shared.bus import refusals
from shared.errors import FORBIDDEN, PublishDenied
from shared.messages import VersionPublished
from shared.subjects import CKPT_STREAM, CKPT_WILDCARD, EVENTS_STREAM, ckpt_published
from shared.versions import BadVersionName, check_version_name

log = logging.getLogger("rollbus.objstore")

CHUNK_SIZE = 1 << 20  # also capped by the server's max_payload
PUT_WINDOW = 16  # outstanding chunk publishes (MiB): bounded, well under 64 MiB
HASH_STRIDE = 8 << 20  # hash a written buffer / prefault a read one in strides this large
HASH_MIN = 1 << 20  # the object reader hashes what landed once this much did (a chunk)
READ_BATCH = 16  # chunks per direct-get batch (MiB in flight): well under 64 MiB
FAST_READ_MIN = 4 << 20  # objects this large are read by shared._fastwire
FAST_PUT_MIN = 4 << 20  # and written through a shared._fastwire.Link
PURGE_SETTLE = 5.0  # a failed put waits this long for in-flight acks before it purges
PURGE_AGAIN_S = 1.0  # then, if some never came, purges again this much later
DIGEST_PREFIX = "SHA-256="
MSG_ID = "Nats-Msg-Id"

Progress = Callable[[int], None]  # called with bytes done so far


class ObjectMissing(Exception):
    """No such object (no meta message, or a deleted one)."""


class ObjectReadError(Exception):
    """The transfer failed (lost chunk, stall, disconnect): nothing was returned."""


class ObjectReadDenied(ObjectReadError):
    """The server refused the transfer's own asking publish (a chunk's direct get or
    publish, a listing's direct get): these credentials lack the grant. A 403 (``code``),
    as :class:`~shared.errors.PublishDenied` is, not a failure a retry heals (503)."""

    code = FORBIDDEN


class ObjectCorrupt(Exception):
    """The bytes arrived but their size or SHA-256 is not what was expected."""


@dataclass
class ObjectMeta:
    name: str
    size: int
    chunks: int
    nuid: str
    digest: str  # hex SHA-256 from the object's own meta ("" if absent)


def _stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def _chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


_NUID = re.compile(r"[A-Za-z0-9]{1,64}")


def new_nuid(nc: Client) -> str:
    """A fresh chunk-subject id, as every NATS client makes one."""
    return str(nc._nuid.next().decode())


async def purge_chunks(nc: Client, bucket: str, nuids: Iterable[object]) -> int:
    """Purge the chunks stored under each of ``nuids`` (those of puts that never wrote
    their meta: a publisher killed mid-upload); the number of ids purged. An id that is
    not a plain NUID (the list comes from a meta message anyone with write access could
    forge) is skipped: it must name one chunk subject, never a wildcard."""
    js = nc.jetstream()
    n = 0
    for nuid in nuids:
        if isinstance(nuid, str) and _NUID.fullmatch(nuid):
            await js.purge_stream(_stream(bucket), subject=_chunk_subject(bucket, nuid))
            n += 1
    return n


# --------------------------------------------------------------------------- replicas


def replicas_for(nc: Client, replicas: int | None = None) -> int:
    """Replicas for rollbus's streams and buckets (events, versions, object store, KV).

    ``replicas`` (else ``ROLLBUS_NATS_REPLICAS``) > 0 is used as is; 0 means auto: 3 when
    the server we are connected to is in a cluster of 3 or more nodes (its INFO lists
    every node's client URL), else 1.
    """
    if replicas is None:
        try:
            replicas = int(os.environ.get("ROLLBUS_NATS_REPLICAS", "0") or 0)
        except ValueError:
            replicas = 0  # the process's settings already refused it at start
    if replicas > 0:
        return replicas
    info = getattr(nc, "_server_info", None) or {}
    nodes = len(set(info.get("connect_urls") or []))
    return 3 if info.get("cluster") and nodes >= 3 else 1


async def _scale_up(js: Any, cfg: api.StreamConfig, replicas: int) -> None:
    """A stream created with fewer replicas (before the cluster grew) gets ``replicas``."""
    if (cfg.num_replicas or 1) < replicas:
        cfg.num_replicas = replicas
        await js.update_stream(cfg)


# --------------------------------------------------------------------------- buckets


def _not_permitted(stream: str, denied: PublishDenied | None = None) -> ObjectReadError:
    # a refusal the server named (a permissions violation) comes at once; a role's
    # missing subscribe permission on the reply, or a server without JetStream, only
    # leaves the JetStream API call unanswered
    if denied is None:
        return ObjectReadError(
            f"cannot create or configure stream {stream}: no answer (this role may not: "
            f"the engine creates it at start, so start `rollbus serve` first)"
        )
    if denied.subject.startswith(("$JS.API.STREAM.CREATE.", "$JS.API.STREAM.UPDATE.")):
        advice = "the engine creates it at start, so start `rollbus serve` first"
    else:  # may not even look at it: no engine's start helps (the operator's, say)
        advice = "use the trainer's credentials"
    return ObjectReadError(
        f"cannot create or configure stream {stream}: {denied.message}; {advice}"
    )


async def ensure_bucket(nc: Client, bucket: str, replicas: int | None = None) -> None:
    try:
        await _ensure_bucket(nc, bucket, replicas)
    except TimeoutError:
        raise _not_permitted(_stream(bucket)) from None
    except PublishDenied as e:
        raise _not_permitted(_stream(bucket), e) from None


async def _ensure_bucket(nc: Client, bucket: str, replicas: int | None = None) -> None:
    js = nc.jetstream()
    n = replicas_for(nc, replicas)
    try:
        await js.object_store(bucket)
    except NotFoundError:
        try:
            await js.create_object_store(bucket, api.ObjectStoreConfig(bucket=bucket, replicas=n))
            return
        except BadRequestError:  # created concurrently by another publisher
            await js.object_store(bucket)
    cfg = (await js.stream_info(_stream(bucket))).config
    if not cfg.allow_direct:  # our reader uses direct get (a bucket made by an old client)
        cfg.allow_direct = True
        await js.update_stream(cfg)
    await _scale_up(js, cfg, n)


async def _js_retry(what: str, fn: Callable[[], Awaitable[Any]], nc: Client, wait: float) -> Any:
    """``fn()``, again for up to ``wait`` s while JetStream does not answer: on a cluster,
    a node's death leaves the stream without a leader for a few seconds. ``NotFoundError``
    is an answer and is raised at once."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return await fn()
        except NotFoundError:
            raise
        except (NatsError, TimeoutError) as e:
            if time.monotonic() >= deadline or nc.is_closed:
                raise ObjectReadError(f"{what}: {e!r}") from None
            await asyncio.sleep(0.25)


async def last_meta(
    nc: Client, bucket: str, name: str, wait: float = 10.0
) -> tuple[int, dict[str, Any]]:
    """``(stream sequence, decoded JSON)`` of the object's last meta message, ``(0, {})``
    when there is none: what a compare-and-set write of the meta expects
    (:func:`put_meta_if`). A deleted object's marker is returned as it is."""
    js = nc.jetstream()
    try:
        msg = await _js_retry(
            f"{name}: cannot read the object's meta",
            lambda: js.get_last_msg(_stream(bucket), _meta_subject(bucket, name)),
            nc,
            wait,
        )
    except NotFoundError:
        return 0, {}
    try:
        info = json.loads(msg.data or b"{}")
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise ObjectCorrupt(f"{name}: its meta is not a JSON object")
    return int(msg.seq or 0), info


def _object_meta(name: str, info: dict[str, Any]) -> ObjectMeta | None:
    """The object a meta message describes; None for a deleted (or no) object."""
    if not info or info.get("deleted") or not info.get("nuid"):
        return None
    try:
        digest = str(info.get("digest") or "")
        hexd = ""
        if digest.upper().startswith(DIGEST_PREFIX):
            raw = digest[len(DIGEST_PREFIX) :]
            hexd = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
        return ObjectMeta(
            name, int(info.get("size") or 0), int(info.get("chunks") or 0), str(info["nuid"]), hexd
        )
    except (TypeError, ValueError):  # binascii.Error is a ValueError
        raise ObjectCorrupt(f"{name}: its meta does not describe an object") from None


async def get_meta(nc: Client, bucket: str, name: str, wait: float = 10.0) -> ObjectMeta:
    """The object's meta, or :class:`ObjectMissing` (:class:`ObjectReadError` when the
    server does not answer within ``wait`` s, e.g. JetStream still recovering after a
    restart or electing a new stream leader)."""
    meta = _object_meta(name, (await last_meta(nc, bucket, name, wait))[1])
    if meta is None:
        raise ObjectMissing(f"{bucket}/{name}")
    return meta


async def object_present(nc: Client, bucket: str, name: str, timeout: float = 1.0) -> bool | None:
    """Whether object ``name`` exists (its last meta message describes one: not deleted,
    not a publisher's claim), by one direct get of that meta subject — a right that
    reads metas only, never chunks (the engine's: ``$JS.API.DIRECT.GET.OBJ_<b>.$O.<b>.M.>``).
    None when that cannot be told (no answer within ``timeout`` — no stream, no server,
    no subscribe permission on the reply —, an answer that does not parse).
    :class:`PublishDenied` (403, at once) when the server refuses the look itself: that
    is known, and not the same as no answer (the caller says "refused", not "no answer")."""
    subject = f"$JS.API.DIRECT.GET.{_stream(bucket)}.{_meta_subject(bucket, name)}"
    try:
        msg = await nc.request(subject, b"", timeout=timeout)
    except (NatsError, TimeoutError):
        return None
    status = (msg.headers or {}).get("Status")
    if not msg.data:
        return False if status == "404" else None
    try:
        info = json.loads(msg.data)
        return _object_meta(name, info if isinstance(info, dict) else {}) is not None
    except (ValueError, ObjectCorrupt):
        return None


class ObjectConflict(Exception):
    """A compare-and-set write of an object's meta lost: another writer wrote it first."""


WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-sequence check


async def put_meta_if(
    nc: Client,
    bucket: str,
    name: str,
    info: dict[str, Any],
    expect_seq: int,
    on: str | None = None,
) -> int:
    """Write ``info`` as the meta message of ``name`` only if the last one is still the
    one at stream sequence ``expect_seq`` (0: none); the new sequence, else
    :class:`ObjectConflict`. Earlier meta messages of the name are rolled up. ``on``:
    the check is on object ``on``'s last meta instead (a fence, e.g. a publisher's
    claim: nats-server ≥ 2.11, see :func:`can_fence`)."""
    headers = {"Nats-Rollup": "sub", "Nats-Expected-Last-Subject-Sequence": str(expect_seq)}
    if on is not None:
        headers["Nats-Expected-Last-Subject-Sequence-Subject"] = _meta_subject(bucket, on)
    try:
        ack = await nc.jetstream().publish(
            _meta_subject(bucket, name), json.dumps(info).encode(), headers=headers
        )
    except APIError as e:
        if e.err_code == WRONG_LAST_SEQUENCE:
            raise ObjectConflict(f"{bucket}/{name}: written meanwhile by another writer") from None
        raise
    return int(ack.seq)


def can_fence(nc: Client) -> bool:
    """Whether the server checks ``put_meta_if(on=...)`` (nats-server 2.11 added the
    header; an older one ignores it and would check ``name``'s own sequence)."""
    v = nc.connected_server_version
    try:
        return (v.major, v.minor) >= (2, 11)
    except Exception:  # noqa: BLE001 - a version nats-py cannot parse: assume not
        return False


# --------------------------------------------------------------------------- writer


async def put_object(
    nc: Client,
    bucket: str,
    name: str,
    data: bytes | bytearray | memoryview | mmap.mmap,
    progress: Progress | None = None,
    *,
    ready: Callable[[int], Awaitable[None]] | None = None,
    digest: Callable[[], Awaitable[str]] | None = None,
    gather: Callable[[int, int], list[memoryview]] | None = None,
    ack_timeout: float = 30.0,
    fast: bool = True,
    cas: bool = False,
    expect_seq: int | None = None,
    nuid: str | None = None,
    write_meta: Callable[[dict[str, Any], int], Awaitable[None]] | None = None,
) -> ObjectMeta:
    """Write ``data`` as object ``name``; chunks first (pipelined), meta last.

    Chunks go out as slices of ``data`` (no copy of ours), at most :data:`PUT_WINDOW`
    unacknowledged at a time: for an object of :data:`FAST_PUT_MIN` bytes or more over a
    plain-TCP connection of its own (:class:`shared._fastwire.Link`: each slice handed
    to the kernel as is) unless ``fast`` is False or that cannot be had (TLS: then,
    and for small objects, through nats-py's connection). The SHA-256 of the meta is
    computed on a helper thread while the chunks are sent, unless ``digest`` (an
    awaitable of the hex digest) gives it. ``ready(n)``, when given, is awaited before a
    chunk that ends at byte ``n`` is sent: ``data`` may still be being written behind it
    (then ``digest`` is required). ``gather(a, b)``, when given, returns the bytes
    ``a:b`` of the object as a list of buffers (some may be memory other than ``data``,
    which then only gives the size): a chunk is sent as those parts, in one ``sendmsg``
    on the fast path (joined only for nats-py's publish); it too needs ``digest``.
    ``progress(n)`` is called with the bytes acknowledged so far. ``cas``: the meta is
    written only if no other writer wrote (or deleted) the object since this put began,
    else :class:`ObjectConflict` (its chunks purged, the other writer's object kept);
    ``expect_seq``: only if the name's last meta message is still the one at that stream
    sequence (e.g. the writer's own claim, see :func:`put_meta_if`). ``nuid``: the
    chunk subject's id, chosen by the caller (a publisher records it beforehand, so the
    chunks of a put killed before its meta can be found and purged: :func:`purge_chunks`).
    ``write_meta(info, seq)``: writes the meta instead (``seq``: the name's last meta
    sequence when the put began), e.g. fenced on a claim; :class:`ObjectConflict` from
    it fails the put like a lost compare-and-set.
    """
    if (ready is not None or gather is not None) and digest is None:
        raise ValueError(
            "put_object: ready=/gather= need digest= (the bytes are not all "
            "in data, or not final yet)"
        )
    js = nc.jetstream()
    view = memoryview(data).cast("B")
    size = len(view)
    chunk = max(1024, min(CHUNK_SIZE, nc.max_payload))
    nuid = nuid or new_nuid(nc)
    subj = _chunk_subject(bucket, nuid)
    seq0, info0 = await last_meta(nc, bucket, name)
    old = _object_meta(name, info0)

    loop = asyncio.get_running_loop()
    pool: ThreadPoolExecutor | None = None
    hashed: asyncio.Future[str] | None = None
    inbox = nc.new_inbox()
    inflight: dict[str, int] = {}  # reply subject -> chunk size
    window = asyncio.Semaphore(PUT_WINDOW)
    errors: list[str] = []
    acked = 0
    all_acked: asyncio.Future[None] = loop.create_future()
    n_chunks = (size + chunk - 1) // chunk

    def on_ack(subject: str, body: bytes, status: str = "") -> None:
        nonlocal acked
        n = inflight.pop(subject, None)
        if n is None:
            return
        window.release()
        err = _ack_error(body, status)
        if err is not None:
            errors.append(err)
            if not all_acked.done():
                all_acked.set_exception(ObjectReadError(f"put {bucket}/{name}: {err}"))
            return
        acked += n
        if progress:
            progress(acked)
        if acked == size and not all_acked.done():
            all_acked.set_result(None)

    async def on_msg(msg: Msg) -> None:
        on_ack(msg.subject, msg.data or b"", (msg.headers or {}).get("Status", ""))

    def on_close(exc: Exception) -> None:
        if not all_acked.done():
            # the link's own error (ObjectReadDenied for a refused chunk: still a 403)
            err = exc if isinstance(exc, ObjectReadError) else ObjectReadError(str(exc))
            all_acked.set_exception(type(err)(f"put {bucket}/{name}: {exc}"))

    def on_refused(e: PublishDenied) -> None:
        # every chunk goes to the one refused subject: none is stored, no ack will come
        # (nor is one awaited before the purge)
        inflight.clear()
        errors.append(e.message)
        if not all_acked.done():
            all_acked.set_exception(ObjectReadDenied(f"put {bucket}/{name}: {e.message}"))
        window.release()  # a send waiting for room goes on, sees the error and stops

    link: Any = None
    sub = None
    held = contextlib.ExitStack()
    held.enter_context(refusals(nc, subj, "", on_refused))  # chunks sent on nc
    try:  # everything that holds a resource is inside: a failure or a cancel frees it
        if digest is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")
            hashed = loop.run_in_executor(pool, _sha256_hex, view)
        if fast and size >= FAST_PUT_MIN:
            from shared import _fastwire

            link = await _fastwire.link(nc, send_timeout=ack_timeout)
        if link is not None:
            link.on_msg, link.on_close = on_ack, on_close
            await link.send(b"SUB %s.* 1\r\n" % inbox.encode())  # before any PUB: in order
        else:
            sub = await nc.subscribe(inbox + ".*", cb=on_msg)
        if size == 0:
            all_acked.set_result(None)
        for i in range(n_chunks):
            if errors:
                break
            off = i * chunk
            end = min(size, off + chunk)
            if ready is not None:
                await ready(end)
            parts = gather(off, end) if gather is not None else [view[off:end]]
            if gather is not None and sum(p.nbytes for p in parts) != end - off:
                raise ValueError(
                    f"put {bucket}/{name}: gather({off}, {end}) gave "
                    f"{sum(p.nbytes for p in parts)} bytes"
                )
            try:
                if window.locked():  # only a full window waits (and only then with a timer)
                    await asyncio.wait_for(window.acquire(), ack_timeout)
                else:
                    await window.acquire()
            except TimeoutError:
                raise ObjectReadError(
                    f"put {bucket}/{name}: no ack for {ack_timeout:g}s (server gone?)"
                ) from None
            reply = f"{inbox}.{i}"
            inflight[reply] = end - off
            if link is not None:
                try:
                    await link.send(
                        b"PUB %s %s %d\r\n" % (subj.encode(), reply.encode(), end - off),
                        *parts,
                        b"\r\n",
                    )
                except ObjectReadError as e:  # the link ended: say which put (a 403 stays one)
                    raise type(e)(f"put {bucket}/{name}: {e}") from None
                continue
            w = _direct_writer(nc)
            if w is not None:  # straight from our buffer to the socket
                w.write(b"PUB %s %s %d\r\n" % (subj.encode(), reply.encode(), end - off))
                for p in parts:
                    w.write(p)
                w.write(b"\r\n")
                await asyncio.sleep(0)  # let the transport write it out
            else:
                payload = parts[0] if len(parts) == 1 else b"".join(parts)
                await nc.publish(subj, payload, reply=reply)  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(asyncio.shield(all_acked), ack_timeout)
        except TimeoutError:
            raise ObjectReadError(
                f"put {bucket}/{name}: {len(inflight)} chunks unacknowledged after {ack_timeout:g}s"
            ) from None
        hexd = await (digest() if digest is not None else hashed)  # type: ignore[misc]
        info = api.ObjectInfo(
            name=name,
            bucket=bucket,
            nuid=nuid,
            size=size,
            chunks=n_chunks,
            mtime=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            digest=DIGEST_PREFIX + base64.urlsafe_b64encode(bytes.fromhex(hexd)).decode(),
            options=api.ObjectMetaOptions(max_chunk_size=chunk),
        )
        if write_meta is not None:
            await write_meta(info.as_dict(), seq0)
        elif cas or expect_seq is not None:
            await put_meta_if(
                nc, bucket, name, info.as_dict(), seq0 if expect_seq is None else expect_seq
            )
        else:
            await js.publish(
                _meta_subject(bucket, name),
                json.dumps(info.as_dict()).encode(),
                headers={"Nats-Rollup": "sub"},
            )
    except BaseException:
        if not all_acked.done():
            all_acked.cancel()
        elif not all_acked.cancelled():
            all_acked.exception()  # retrieved: the error raised is the one that matters
        if hashed is not None and hashed.done() and not hashed.cancelled():
            hashed.exception()
        try:
            # chunks sent and not yet acknowledged would be stored after the purge: wait
            # for their acks (briefly), else reset the link so its unsent bytes are dropped
            deadline = loop.time() + min(ack_timeout, PURGE_SETTLE)
            while (
                inflight
                and not nc.is_closed
                and loop.time() < deadline
                and (link is None or link.error is None)
            ):
                await asyncio.sleep(0.02)
            unsettled = bool(inflight)
            if link is not None:
                if unsettled:
                    link.abort()
                await link.close()
            await js.purge_stream(_stream(bucket), subject=subj)
            if unsettled:
                # bytes the server had already read from the ended link are stored on its
                # own schedule, unordered with this connection's purge: purge once more
                await asyncio.sleep(PURGE_AGAIN_S)
                await js.purge_stream(_stream(bucket), subject=subj)
        except Exception:  # noqa: BLE001 - the original error is what matters
            pass
        raise
    finally:
        held.close()
        if link is not None:
            await link.close()
        if sub is not None:
            await sub.unsubscribe()
        if pool is not None:
            pool.shutdown(wait=False)
    if old is not None:
        await js.purge_stream(_stream(bucket), subject=_chunk_subject(bucket, old.nuid))
    return ObjectMeta(name, size, n_chunks, nuid, hexd)


def _ack_error(body: bytes, status: str) -> str | None:
    """None for a JetStream publish ack (``{"stream": ..., "seq": n}``), else what is
    wrong with it: an error ack, no ack (a status, e.g. no stream), or no ack at all."""
    if not body:
        return f"no ack{f' (status {status})' if status else ''} (no JetStream stream?)"
    try:
        ack = json.loads(body)
    except ValueError:
        ack = None
    if not isinstance(ack, dict):
        return f"not a JetStream ack: {body[:80]!r}"
    if "error" in ack:
        return str(ack["error"])
    if not ack.get("stream") or not isinstance(ack.get("seq"), int):
        return f"not a JetStream ack: {body[:80]!r}"
    return None


def _direct_writer(nc: Client) -> asyncio.StreamWriter | None:
    """nats-py's socket writer, when a chunk may go straight to it: a plain connected
    stream and nothing of nats-py's own waiting to be written before it (so the order of
    commands is kept; our ack subscription is always written first). nats-py's publish
    would copy each 1 MiB chunk twice more (command concatenation, then the join of its
    pending list) before the socket copies it. Else None: publish through nats-py."""
    tr = getattr(nc, "_transport", None)
    w = getattr(tr, "_io_writer", None)
    if (
        not isinstance(w, asyncio.StreamWriter)
        or not nc.is_connected
        or nc._pending_data_size
        or w.transport.is_closing()
    ):
        return None
    return w


def _sha256_hex(view: memoryview) -> str:
    sha = hashlib.sha256()
    for a in range(0, len(view), HASH_STRIDE):
        sha.update(view[a : a + HASH_STRIDE])  # releases the GIL: overlaps the sending
    return sha.hexdigest()


# --------------------------------------------------------------------------- reader


MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def _prefault(buf: mmap.mmap, size: int, stop: threading.Event) -> None:
    """Fault the buffer's pages in ahead of the writer, on a helper thread.

    First-touch page faults cost about as much as the transfer itself on this kind of VM
    (~1 GB/s); ``madvise(MADV_POPULATE_WRITE)`` (through ctypes, so the GIL is released)
    does them in parallel and never changes a byte already written."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        anchor = ctypes.c_char.from_buffer(buf)
    except (OSError, AttributeError, TypeError):
        return
    addr = ctypes.addressof(anchor)
    for a in range(0, size, HASH_STRIDE):
        if stop.is_set():  # the read failed: the buffer is being closed
            break
        if libc.madvise(addr + a, min(HASH_STRIDE, size - a), MADV_POPULATE_WRITE) != 0:
            break  # not supported here: the writer faults pages itself
    del anchor


class _Hasher:
    """SHA-256 of a buffer's growing prefix, on a helper thread, as the bytes land.

    The reader calls :meth:`feed` with the length filled so far; the helper thread hashes
    whatever has landed since it last looked: a chunk (at least :data:`HASH_MIN` bytes)
    at a time while it keeps up, everything landed so far when it is behind. So the hash
    runs beside the receipt, over bytes written a moment ago, and when the last chunk
    lands only the bytes that came in during the last update are left to hash. The bytes
    are hashed in place (slices of the buffer, never copied); ``hashlib`` releases the
    GIL while it hashes. One helper run at a time: the digest is of the bytes in order."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.sha = hashlib.sha256()
        self.filled = 0  # bytes landed (the reader's)
        self.hashed = 0  # bytes hashed (the helper's)
        self.final = False
        self.running = False  # a helper run is queued or hashing
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self.dead = False  # the read failed: nothing more is hashed

    def feed(self, upto: int, final: bool = False) -> None:
        with self.lock:
            self.filled = upto
            self.final = self.final or final
            if self.running or (upto - self.hashed < HASH_MIN and not final):
                return
            self.running = True
        self.pool.submit(self._run)

    def _run(self) -> None:
        while True:
            with self.lock:
                a, b = self.hashed, self.filled
                if self.dead or b - a < (1 if self.final else HASH_MIN):
                    self.running = False
                    return
            self.sha.update(self.view[a:b])  # the slice lives only while it is hashed
            with self.lock:
                self.hashed = b

    async def hexdigest(self) -> str:
        """The digest, once every byte fed with ``final`` is hashed (the pool runs in
        order: after the helper run that hashes the last bytes)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.sha.hexdigest)


async def read_object(
    nc: Client,
    bucket: str,
    name: str,
    *,
    expect_size: int | None = None,
    expect_sha256: str | None = None,
    max_size: int | None = None,
    stall_timeout: float = 5.0,
    progress: Progress | None = None,
    fast: bool = True,
) -> mmap.mmap:
    """Read object ``name`` into a fresh anonymous mmap of its size.

    An object of :data:`FAST_READ_MIN` bytes or more is read over a connection of its
    own with frames parsed by :mod:`shared._fastwire` (payloads received straight into
    the buffer), unless ``fast`` is False or that connection cannot be had; else, and
    for small objects, through nats-py on ``nc``.

    Raises :class:`ObjectMissing`, :class:`ObjectCorrupt` (size differs from the meta or
    ``expect_size``, or exceeds ``max_size`` — both checked before anything is
    allocated; SHA-256 differs from ``expect_sha256`` when given) or
    :class:`ObjectReadError` (lost chunk, no data for ``stall_timeout`` s, disconnect;
    at once, naming the subject, when the server refuses a chunk request's publish).
    :class:`~shared.errors.PublishDenied` when the meta's own read is refused.
    """
    meta = await get_meta(nc, bucket, name)
    if expect_size is not None and meta.size != expect_size:
        raise ObjectCorrupt(f"{name}: stored size {meta.size} != expected {expect_size}")
    if max_size is not None and meta.size > max_size:
        raise ObjectCorrupt(f"{name}: stored size {meta.size} exceeds the limit {max_size}")
    # private anonymous memory: shared anonymous memory (mmap's default) is shmem, whose
    # page faults and unmapping cost ≈ 1.6× as much CPU (page cache bookkeeping per page).
    # No madvise(MADV_HUGEPAGE): measured on this VM, a fresh process's 2 MiB pages fault
    # in slower, not faster (only pages recycled in-process are cheap), so the pull's CPU
    # only grew noisier (README, "Pull").
    buf = mmap.mmap(-1, max(1, meta.size), flags=mmap.MAP_PRIVATE)
    if meta.size == 0:
        return buf
    stop = threading.Event()
    prefault = threading.Thread(target=_prefault, args=(buf, meta.size, stop), daemon=True)
    prefault.start()
    view = memoryview(buf)
    hasher = _Hasher(view) if expect_sha256 else None
    try:
        if (
            fast
            and meta.size >= FAST_READ_MIN
            and await _read_fast(nc, bucket, meta, view, hasher, progress, stall_timeout)
        ):
            return await _verified(buf, meta, hasher, expect_sha256)
        return await _read_nats_py(
            nc, bucket, meta, buf, view, hasher, progress, stall_timeout, expect_sha256
        )
    except BaseException:  # nothing is returned: the buffer is unmapped now, not at GC

        def close() -> None:
            stop.set()
            prefault.join(1.0)  # at most one stride's madvise away
            view.release()
            with contextlib.suppress(BufferError):  # still exported: the GC frees it
                buf.close()

        if hasher:
            hasher.dead = True
            hasher.pool.submit(close)  # after the update being hashed, if any
        else:
            close()
        raise
    finally:
        if hasher:
            hasher.pool.shutdown(wait=False)


async def _read_fast(
    nc: Client,
    bucket: str,
    meta: ObjectMeta,
    view: memoryview,
    hasher: _Hasher | None,
    progress: Progress | None,
    stall_timeout: float,
) -> bool:
    """The object read by :mod:`shared._fastwire`; False: it could not connect."""
    from shared import _fastwire

    frames = await _fastwire.connect(nc)
    if frames is None:
        return False

    def on_filled(n: int) -> None:
        if hasher:
            hasher.feed(n)
        if progress:
            progress(n)

    await _fastwire.read_into(
        frames,
        nc,
        meta.name,
        _stream(bucket),
        _chunk_subject(bucket, meta.nuid),
        view[: meta.size],
        meta.chunks,
        READ_BATCH,
        stall_timeout,
        on_filled,
    )
    return True


async def _verified(
    buf: mmap.mmap, meta: ObjectMeta, hasher: _Hasher | None, expect_sha256: str | None
) -> mmap.mmap:
    if hasher and expect_sha256:
        hasher.feed(meta.size, final=True)
        got = await hasher.hexdigest()
        if got != expect_sha256:
            raise ObjectCorrupt(
                f"{meta.name}: SHA-256 {got[:12]}… != expected {expect_sha256[:12]}…"
            )
    return buf


async def _read_nats_py(
    nc: Client,
    bucket: str,
    meta: ObjectMeta,
    buf: mmap.mmap,
    view: memoryview,
    hasher: _Hasher | None,
    progress: Progress | None,
    stall_timeout: float,
    expect_sha256: str | None,
) -> mmap.mmap:
    name = meta.name
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    state = {
        "off": 0,
        "dseq": 0,
        "sseq": 0,
        "last": time.monotonic(),
        "asked": 0,
        "ended": 0,
        "in_batch": 0,
    }

    def fail(exc: Exception) -> None:
        if not done.done():
            done.set_exception(exc)

    stream, subject = _stream(bucket), _chunk_subject(bucket, meta.nuid)
    inbox = nc.new_inbox()

    async def ask(seq: int) -> None:
        req = {"seq": seq, "next_by_subj": subject, "batch": READ_BATCH}
        state["asked"] += 1
        state["in_batch"] = 0
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(req).encode(), reply=inbox)

    async def on_msg(msg: Msg) -> None:
        if done.done():
            return
        state["last"] = time.monotonic()
        hdr = msg.headers or {}
        status = hdr.get("Status", "")
        if status == "204":  # end of a batch: ask the next one unless that was done
            state["ended"] += 1
            if state["asked"] == state["ended"] and int(state["off"]) < meta.size:
                await ask(int(state["sseq"]) + 1)
            return
        if status == "404":  # the stream ran out of chunks before the object was whole
            fail(
                ObjectCorrupt(
                    f"{name}: chunks missing: got {state['dseq']} of "
                    f"{meta.chunks} chunks before the stream ran out"
                )
            )
            return
        if status:
            fail(
                ObjectReadError(
                    f"{name}: chunk read refused: {status} {hdr.get('Description', '')}".strip()
                )
            )
            return
        sseq, pending = int(hdr.get("Nats-Sequence", 0)), int(hdr.get("Nats-Num-Pending", -1))
        if hdr.get("Nats-Subject") != subject or sseq <= int(state["sseq"]):
            fail(ObjectReadError(f"{name}: unexpected message {sseq} on the chunk inbox"))
            return
        state["sseq"] = sseq
        state["dseq"] += 1
        dseq = int(state["dseq"])
        off, n = int(state["off"]), len(msg.data)
        if off + n > meta.size:
            fail(ObjectCorrupt(f"{name}: more than the stored size {meta.size} bytes"))
            return
        view[off : off + n] = msg.data
        state["off"] = off + n
        if hasher:
            hasher.feed(off + n)
        if progress:
            progress(off + n)
        state["in_batch"] += 1
        if (
            state["in_batch"] == READ_BATCH
            and state["asked"] == state["ended"] + 1
            and pending != 0
            and off + n < meta.size
        ):
            await ask(sseq + 1)  # a batch's last chunk: the next batch starts after it
        if pending == 0 or off + n == meta.size:
            if off + n != meta.size:
                fail(ObjectCorrupt(f"{name}: got {off + n} bytes, stored size {meta.size}"))
            elif dseq != meta.chunks:
                fail(ObjectCorrupt(f"{name}: got {dseq} chunks, stored {meta.chunks}"))
            elif not done.done():
                done.set_result(None)

    async def on_chunk(msg: Msg) -> None:
        try:
            await on_msg(msg)
        except Exception as e:  # a bug here must end the read loudly, not stall it
            log.exception("object reader: %s failed", name)
            fail(ObjectReadError(f"{name}: reader failed: {e!r}"))

    def refused(e: PublishDenied) -> None:  # asked of no one: no chunk will come
        fail(ObjectReadDenied(f"{name}: {e.message}"))

    sub = await nc.subscribe(inbox, cb=on_chunk, pending_bytes_limit=96 << 20)
    try:
        try:
            with refusals(nc, f"$JS.API.DIRECT.GET.{stream}", inbox, refused):
                state["last"] = time.monotonic()
                await ask(1)
                while not done.done():  # watchdog: a stall or a disconnect ends the read
                    await asyncio.wait({done}, timeout=0.25)
                    if done.done():
                        break
                    if not nc.is_connected:
                        fail(ObjectReadError(f"{name}: NATS connection lost mid-read"))
                    elif time.monotonic() - state["last"] > stall_timeout:
                        fail(ObjectReadError(f"{name}: no data for {stall_timeout:g}s"))
                done.result()
        except (NatsError, TimeoutError) as e:
            raise ObjectReadError(f"{name}: {e!r}") from None
        return await _verified(buf, meta, hasher, expect_sha256)
    finally:
        if nc.is_connected:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing anyway
                pass


# --------------------------------------------------------------------------- versions


async def ensure_ckpt_stream(nc: Client, model: str = "", replicas: int | None = None) -> None:
    try:
        await _ensure_ckpt_stream(nc, model, replicas)
    except TimeoutError:
        raise _not_permitted(CKPT_STREAM) from None
    except PublishDenied as e:
        raise _not_permitted(CKPT_STREAM, e) from None


async def _ensure_ckpt_stream(nc: Client, model: str = "", replicas: int | None = None) -> None:
    """Make sure ``ROLLBUS_CKPT`` exists and captures ``rollbus.ckpt.*.published``.

    (The events stream lists one ``rollbus.<instance>.events.>`` per instance, so the two
    streams never overlap; the instance name ``ckpt`` is refused at start.)
    """
    js = nc.jetstream()
    n = replicas_for(nc, replicas)
    for _ in range(5):
        try:
            info = await js.stream_info(CKPT_STREAM)
        except NotFoundError:
            try:
                await js.add_stream(
                    api.StreamConfig(
                        name=CKPT_STREAM,
                        subjects=[CKPT_WILDCARD],
                        duplicate_window=3600.0,
                        storage=api.StorageType.FILE,
                        num_replicas=n,
                        allow_direct=True,
                    )
                )
                return
            except BadRequestError:
                continue  # created concurrently: look again
        cfg = info.config
        if cfg.subjects == [CKPT_WILDCARD] and cfg.allow_direct:
            await _scale_up(js, cfg, n)
            return
        cfg.subjects = [CKPT_WILDCARD]  # older per-model subject lists are folded in
        cfg.allow_direct = True  # readers use direct get (no consumer: see _direct_all)
        cfg.num_replicas = max(cfg.num_replicas or 1, n)
        await js.update_stream(cfg)
    raise ObjectReadError(f"cannot configure stream {CKPT_STREAM}")


async def ensure_events_stream(nc: Client, subject: str, replicas: int | None = None) -> None:
    """Make ``ROLLBUS_EVENTS`` capture this instance's ``rollbus.<i>.events.>``.

    One subject per instance, not ``rollbus.*.events.>``: that wildcard would overlap
    the checkpoint stream's ``rollbus.ckpt.*.published`` and JetStream refuses
    overlapping streams.
    """
    js = nc.jetstream()
    n = replicas_for(nc, replicas)
    for _ in range(5):
        try:
            info = await js.stream_info(EVENTS_STREAM)
        except NotFoundError:
            try:
                await js.add_stream(
                    api.StreamConfig(
                        name=EVENTS_STREAM,
                        subjects=[subject],
                        max_age=7 * 24 * 3600.0,
                        max_msgs=1_000_000,
                        num_replicas=n,
                        allow_direct=True,
                    )
                )
                return
            except BadRequestError:
                continue  # created concurrently: look again
        cfg = info.config
        subjects = [x for x in cfg.subjects or [] if x != "rollbus.*.events.>"]
        if subject in subjects and subjects == (cfg.subjects or []) and cfg.allow_direct:
            await _scale_up(js, cfg, n)
            return
        cfg.allow_direct = True  # the operator reads events by direct get
        cfg.subjects = subjects if subject in subjects else [*subjects, subject]
        cfg.num_replicas = max(cfg.num_replicas or 1, n)
        await js.update_stream(cfg)
    raise ObjectReadError(f"cannot add {subject} to stream {EVENTS_STREAM}")


async def publish_version(nc: Client, ev: VersionPublished) -> int:
    """Publish the version event; returns its stream sequence (the existing one for a
    duplicate within the dedup window)."""
    ack = await nc.jetstream().publish(
        ckpt_published(ev.model),
        msgspec.json.encode(ev),
        headers={MSG_ID: f"{ev.model}/{ev.version}"},
        timeout=10,
    )
    return int(ack.seq)


def _event(data: bytes) -> VersionPublished | None:
    """A version event, or None for one that is not ours: not a ``VersionPublished``, or
    a version no rank could ever load (not a valid name: empty, ``a/b``, ``..``; the SDK
    never publishes one) — counted, it would be the newest version forever (``update_weights``'
    default, a staleness bound that can never be met)."""
    try:
        ev = msgspec.json.decode(data, type=VersionPublished)
        check_version_name(ev.version)
    except (msgspec.ValidationError, msgspec.DecodeError, BadVersionName):
        return None
    return ev


def _decode(msg: Msg) -> tuple[int, VersionPublished] | None:
    ev = _event(msg.data)
    if ev is None:
        return None  # not ours: skip, never crash a follower
    return int(msg.metadata.sequence.stream), ev


async def _direct_all(nc: Client, stream: str, subject: str, timeout: float = 5.0) -> list[Msg]:
    """Every stored message of ``subject`` in ``stream``, oldest first, by batched direct
    get (``$JS.API.DIRECT.GET``: no consumer is created, so a reader needs no right to
    create one — a push consumer would deliver wherever its creator says)."""
    inbox = nc.new_inbox()
    queue: asyncio.Queue[Msg | PublishDenied] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    api_subject = f"$JS.API.DIRECT.GET.{stream}"
    sub = await nc.subscribe(inbox, cb=on_msg)
    out: list[Msg] = []
    seq = 1
    try:
        # a refused ask reached no one: said at once, not after ``timeout``
        with refusals(nc, api_subject, inbox, queue.put_nowait):
            while True:
                req = {"seq": seq, "next_by_subj": subject, "batch": 256}
                await nc.publish(api_subject, json.dumps(req).encode(), reply=inbox)
                while True:
                    msg = await asyncio.wait_for(queue.get(), timeout)
                    if isinstance(msg, PublishDenied):
                        raise ObjectReadDenied(f"{stream}: {msg.message}")
                    hdr = msg.headers or {}
                    status = hdr.get("Status", "")
                    if status == "404":
                        return out
                    if status == "204":
                        break
                    if status:
                        raise ObjectReadError(f"{stream}: direct get refused: {status}")
                    out.append(msg)
                    seq = int(hdr.get("Nats-Sequence", seq)) + 1
                    if hdr.get("Nats-Num-Pending") == "0":
                        return out
    except TimeoutError:
        raise ObjectReadError(f"{stream}: no answer to a direct get within {timeout:g}s") from None
    finally:
        await sub.unsubscribe()


def _decode_direct(msg: Msg) -> tuple[int, VersionPublished] | None:
    ev = _event(msg.data)
    if ev is None:
        return None  # not ours: skip
    return int((msg.headers or {}).get("Nats-Sequence", 0)), ev


async def list_versions(nc: Client, model: str) -> list[tuple[int, VersionPublished]]:
    """Every published version event of ``model`` in publish order (stream sequence)."""
    js = nc.jetstream()
    try:
        info = await js.stream_info(CKPT_STREAM)
    except NotFoundError:
        return []
    if not info.state.messages:
        return []
    msgs = await _direct_all(nc, CKPT_STREAM, ckpt_published(model))
    return [d for d in map(_decode_direct, msgs) if d]


async def watch_versions(
    nc: Client, model: str, cb: Callable[[int, VersionPublished], Awaitable[None]]
) -> Any:
    """Call ``cb(seq, event)`` for every past and future event of ``model`` (an ordered
    consumer: it survives reconnects). Returns the subscription."""

    async def on_msg(msg: Msg) -> None:
        d = _decode(msg)
        if d:
            await cb(*d)

    return await nc.jetstream().subscribe(
        ckpt_published(model), stream=CKPT_STREAM, ordered_consumer=True, cb=on_msg
    )


class VersionFeed:
    """A durable pull consumer over ``model``'s version events (acks explicit)."""

    def __init__(self, nc: Client, model: str, durable: str) -> None:
        self.nc, self.model, self.durable = nc, model, durable
        self._psub: Any = None

    async def start(self) -> None:
        self._psub = await self.nc.jetstream().pull_subscribe(
            ckpt_published(self.model),
            durable=self.durable,
            stream=CKPT_STREAM,
            config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, ack_wait=600.0),
        )

    async def restart(self) -> None:
        """Subscribe again, re-creating the durable (and the stream) if they are gone: a
        deleted consumer (``nats consumer rm``, JetStream state lost) otherwise fails
        every fetch for ever. A new durable starts at the stream's first event; those
        not newer than the served version are ignored."""
        old, self._psub = self._psub, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()
        await ensure_ckpt_stream(self.nc, self.model)
        await self.start()

    async def fetch(self, timeout: float) -> list[tuple[int, VersionPublished, Msg]]:
        """Every event waiting now (up to 256), oldest first; [] after ``timeout``.
        :class:`PublishDenied` at once when the server refuses the pull request
        (``$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>``): nats-py's fetch waits on the
        subscription's inbox and would end in a timeout, [] ("nothing new") for ever."""
        psub = self._psub
        loop = asyncio.get_running_loop()
        refused: asyncio.Future[PublishDenied] = loop.create_future()

        def on_refused(e: PublishDenied) -> None:
            if not refused.done():
                refused.set_result(e)

        # nats-py's pull subject and inbox (its own names; a stock fetch if they move)
        nms, deliver = str(getattr(psub, "_nms", "")), str(getattr(psub, "_deliver", ""))
        fetching = asyncio.ensure_future(psub.fetch(256, timeout=timeout))
        try:
            with refusals(self.nc, nms, deliver, on_refused):
                await asyncio.wait({fetching, refused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not fetching.done():  # refused, or our caller cancelled
                fetching.cancel()
                await asyncio.gather(fetching, return_exceptions=True)
        if refused.done() and (fetching.cancelled() or fetching.exception() is not None):
            raise refused.result()
        try:
            msgs = fetching.result()
        except TimeoutError:
            return []
        out = []
        for msg in msgs:
            d = _decode(msg)
            if d is None:
                await msg.ack()
                continue
            out.append((d[0], d[1], msg))
        return out

    @staticmethod
    async def ack(msg: Msg) -> None:
        await msg.ack()
