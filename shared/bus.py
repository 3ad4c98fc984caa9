"""The only module that touches nats-py.

One :class:`Bus` per process. It owns:

* a bounded ``connect`` that names the URL it could not reach (nats-py alone keeps
  retrying for minutes);
* one long-lived wildcard reply inbox, subscribed at connect, before any request. Each
  request gets a correlation token of our own making (the last token of its reply
  subject); its future is registered *before* the publish, so a fast reply can never
  arrive to nobody (FastDeploy's race). A caller's request id (any string, e.g. a
  client's ``X-Request-Id``: dots, ``*``, spaces, duplicates) travels only in the
  ``Rollbus-Request-Id`` header, never in a subject, so it cannot break or cross replies;
* ``request`` (one reply) and ``scatter`` (exactly ``expected`` replies, one per rank,
  or a timeout naming the ranks that did not answer). No-responder markers
  (``Status: 503``) fail a request at once and are ignored by a scatter. A reply timer
  that fires (request, scatter, stream) first settles with the server
  (:meth:`Bus.settle`): a reply that only waited unread in this process's socket (it
  was stopped) is taken, not blamed on the peer;
* a lost connection (nats-py then reconnects by itself) fails every request, scatter
  and stream still waiting at once with a 503 saying so (``ConnectionLost``; a scatter
  names the ranks that had not answered): a reply published while our inbox was away is
  gone, so waiting for it would only end at the timeout. The API's bus
  (``fail_when_disconnected``) also refuses new requests while reconnecting
  (``NotConnected``), so nothing waits for the server to come back;
* late or unknown replies are dropped and counted (``dropped_replies``), never kept; so
  is a reply carrying another request's ``Rollbus-Request-Id`` and a JetStream publish
  ack or API answer sent to our inbox (a stream capturing a request's subject acks it);
* a message on a served or subscribed subject that is not a request is dropped and
  counted (``dropped_requests``) before any handler runs: one whose reply subject is not
  an inbox (``_INBOX…``; a JetStream push delivery's ``$JS.ACK…``), one carrying
  JetStream headers (``Nats-Stream``, ``Nats-Sequence``: a stored message delivered by a
  consumer or a direct get), one with neither a reply subject nor a
  ``Rollbus-Request-Id`` (a JetStream API answer sent to a subject named as reply), one
  whose reply subject is a batch inbox (``<prefix>.batch``, below). A
  responder never answers into anything but an inbox, so no client can make the
  server or a responder publish a message onto a subject it may not publish to;
* batched stream replies: a responder answering many streams of one process at once
  (the engine, one token chunk per running request per step) may send them as one
  message to ``<inbox prefix>.batch`` (:func:`batch_subject`, :func:`pack_batch`): a
  msgpack array of ``[reply token, request id, data]``; each item goes to its own
  stream as if sent alone (an item whose token is unknown or whose request id is not the
  one its request was sent with is dropped and counted, like a reply). A batch larger
  than the server's ``max_payload`` goes as several messages, in order
  (:func:`pack_batches`): e.g. a pause that aborts thousands of queued choices at once;
* ``serve``: endpoints registered as a NATS micro service (``$SRV.PING/INFO/STATS``),
  with a queue group per caller (a per-rank group makes a broadcast reach every rank).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import os
import re
import ssl
import time
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats
from nats.aio.client import _HEADER_KEY_RE, _HEADER_VALUE_NEWLINES, Client
from nats.aio.msg import Msg
from nats.micro.request import Request
from nats.micro.service import Service, ServiceConfig
from nats.protocol.command import hpub_cmd, pub_cmd

from shared import creds
from shared.errors import (
    UNAVAILABLE,
    BusUnreachable,
    ConnectionLost,
    ControlError,
    NoResponders,
    NotConnected,
    PublishDenied,
    Timeout,
)
from shared.ratelog import RateLimited
from shared.tasks import guarded

log = logging.getLogger("rollbus.bus")

REQUEST_ID = "Rollbus-Request-Id"
# after a reply timer fired and a PING/PONG (Bus.settle): how long the inbox's callback
# may take to hand over what was read (a few loop turns, unless the inbox is busy)
SILENCE_GRACE_S = 0.25
# how long Bus.settle waits for the server's PONG (nats-py's flush takes whole seconds)
SETTLE_PONG_S = 1
# the longest request id a responder echoes (a client's ``X-Request-Id`` fits: the API's
# request head is at most 64 KiB); a longer one is not echoed (the engine answers 400)
MAX_REQUEST_ID_BYTES = 64 * 1024


# header names already checked (and stripped) by :func:`header_block`: rollbus sends a
# handful of fixed names, each checked once, not per message (bounded: any name works)
_NAMES_OK: dict[str, str] = {}
_NAMES_OK_MAX = 256


def header_block(headers: dict[str, str]) -> bytes:
    """The NATS header block nats-py writes for ``headers`` (``NATS/1.0``, one ``Name:
    value`` line each, a blank line), byte for byte the same — names stripped (an empty
    one skipped, an invalid one ``BadHeaderError``), values stripped with CR and LF
    turned into spaces — built as one string instead of nats-py's ten bytearray calls
    and a regex per header (≈ 6× cheaper: every rollbus request and reply carries one
    to three headers)."""
    parts = ["NATS/1.0\r\n"]
    for k, v in headers.items():
        key = _NAMES_OK.get(k)
        if key is None:
            key = k.strip()
            if not key:
                continue
            if not _HEADER_KEY_RE.fullmatch(key):
                raise nats.errors.BadHeaderError(key)
            if len(_NAMES_OK) < _NAMES_OK_MAX:
                _NAMES_OK[k] = key
        value = v.strip()
        if "\r" in value or "\n" in value:
            value = value.translate(_HEADER_VALUE_NEWLINES)
        parts.append(f"{key}: {value}\r\n")
    parts.append("\r\n")
    return "".join(parts).encode()


# nats-server's answers to a publish it refuses: "to" the subject the connection's
# permissions do not allow (it quotes the concrete subject, never the permission's
# wildcard), or "with reply of" a reply subject the server reserves for itself (``_R_.``:
# service imports' replies, ``$GNR.``: gateways'), whatever the permissions. Seen from
# nats-server 2.15: ``Permissions Violation for Publish with Reply of "_R_.x"``.
_DENIED_RE = re.compile(r'permissions violation for publish (to|with reply of) "(.*)"', re.I)
_DENIED_KEEP = 64  # subjects remembered in _Client.denied (the latest ones)
TO, REPLY = "to", "with reply of"  # what a refusal names (see refusal)


def refusal(err: str) -> tuple[str, str] | None:
    """``(TO, subject)`` or ``(REPLY, reply subject)`` named by a ``-ERR`` text that
    refuses a publish (as the server sent it: the subject in its own case), or None."""
    m = _DENIED_RE.search(err)
    if m is None:
        return None
    return m.group(1).lower(), _unquoted(m.group(2))


@dataclass(eq=False)
class _Watch:
    """One waiter on a publish's outcome: ``fail`` is called with the 403 when the server
    refuses a publish to ``subject``, or one with reply subject ``reply``."""

    subject: str
    reply: str
    fail: Callable[[PublishDenied], None]


def _unquoted(quoted: str) -> str:
    """The subject inside nats-server's quotes: Go's %q escapes a '"' or '\\' in it, and
    any character Go deems unprintable, with escapes Python's string literals share."""
    if "\\" not in quoted:
        return quoted
    try:
        subject = ast.literal_eval(f'"{quoted}"')
    except (SyntaxError, ValueError):  # not Go's quoting after all: the text as it came
        return quoted
    return subject if isinstance(subject, str) else quoted


@contextlib.contextmanager
def refusals(
    nc: Any, subject: str, reply: str, fail: Callable[[PublishDenied], None]
) -> Iterator[None]:
    """While inside: ``fail(PublishDenied)`` as soon as nats-server refuses a publish on
    ``nc`` to ``subject``, or one with reply subject ``reply``. For a reader that waits
    on an inbox of its own (no request future ties its wait to what it published, so
    nothing else would end it before its timeout). A stock nats-py client (not made by
    :meth:`Bus.connect`) cannot tell: such a read ends at its own timeout, as before."""
    watch = getattr(nc, "watch_refusal", None)
    if watch is None:
        yield
        return
    w = watch(subject, reply, fail)
    try:
        yield
    finally:
        nc.unwatch_refusal(w)


class _Client(Client):
    """nats-py's client, refusing here a message whose headers and payload together
    exceed the server's ``max_payload``. nats-py checks the payload alone: a larger
    message goes out, the server answers ``-ERR 'Maximum Payload Violation'`` and
    closes the connection, and nats-py does not reconnect after that error — one
    oversized reply (e.g. echoing a client's huge ``Rollbus-Request-Id``) would cut the
    process off the bus for good. Refused here, only that publish fails.

    A message with headers has its header block built once, by :func:`header_block`
    (its exact size is what the check above compares), and sent as nats-py sends it."""

    # the block built by publish for the headers dict it was given (the same object
    # reaches _send_publish with no await in between)
    _block: tuple[dict[str, str], bytes] | None = None

    def __init__(self) -> None:
        super().__init__()
        # subject -> wall time of the server's latest publish permissions violation on it
        self.denied: dict[str, float] = {}
        # nats-py's own requests (the JetStream API's) waiting for their reply, and the
        # reads of :mod:`shared.objstore` waiting on an inbox of their own (watch_refusal),
        # by the subject they were published to: a refusal of that subject, or of their
        # reply subject, fails them at once
        self._asked: dict[str, set[_Watch]] = {}
        # the Bus's: called with what a refusal names (TO/REPLY) and a match for it
        self.on_denied: Callable[[str, Callable[[str], bool]], None] | None = None

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        watched: tuple[asyncio.Future[Any], _Watch] | None = None
        if reply and self._resp_map:  # nats-py's request: its future is registered
            fut = self._resp_map.get(reply[reply.rfind(".") + 1 :])
            if fut is not None and not fut.done():
                watched = fut, self._watch(subject, reply, fut)
        try:  # (free in 3.11 when nothing raises: the hot path pays nothing for it)
            if headers is None:  # no block to build: nats-py's path, nothing added
                await super().publish(subject, payload, reply=reply)
                return
            block = header_block(headers)
            if len(payload) + len(block) > self._max_payload:
                raise nats.errors.MaxPayloadError
            self._block = (headers, block)
            try:
                await super().publish(subject, payload, reply=reply, headers=headers)
            finally:
                self._block = None
        except BaseException:
            if watched is not None:
                # nats-py never resolves a request's future whose publish raised: it
                # stayed here and in its _resp_map for the connection's life (dropped
                # now, not by the done-callbacks the cancel schedules)
                watched[0].cancel()
                self.unwatch_refusal(watched[1])
                self._resp_map.pop(reply[reply.rfind(".") + 1 :], None)
            raise

    async def _send_publish(
        self,
        subject: str,
        reply: str,
        payload: bytes,
        payload_size: int,
        headers: dict[str, Any] | None,
    ) -> None:
        """nats-py's own ``_send_publish``, with the header block built by
        :func:`header_block` (once, in :meth:`publish`)."""
        if subject == "":
            raise nats.errors.BadSubjectError
        if headers is None:
            cmd = pub_cmd(subject, reply, payload)
        else:
            held = self._block
            block = held[1] if held is not None and held[0] is headers else header_block(headers)
            cmd = hpub_cmd(subject, reply, block, payload)
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += payload_size
        await self._send_command(cmd)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    def _watch(self, subject: str, reply: str, fut: asyncio.Future[Any]) -> _Watch:
        def fail(err: PublishDenied) -> None:
            if not fut.done():
                fut.set_exception(err)

        w = self.watch_refusal(subject, reply, fail)
        fut.add_done_callback(lambda _: self.unwatch_refusal(w))
        return w

    def watch_refusal(
        self, subject: str, reply: str, fail: Callable[[PublishDenied], None]
    ) -> _Watch:
        """Have ``fail`` called with the 403 when the server refuses a publish to
        ``subject`` or one with reply subject ``reply``, until :meth:`unwatch_refusal`."""
        w = _Watch(subject, reply, fail)
        self._asked.setdefault(subject, set()).add(w)
        return w

    def unwatch_refusal(self, w: _Watch) -> None:
        waiting = self._asked.get(w.subject)
        if waiting is not None:
            waiting.discard(w)
            if not waiting:
                del self._asked[w.subject]

    async def _process_err(self, err_msg: str) -> None:
        """nats-py's own, after noting a publish permissions violation: nats-py hands it
        to ``error_cb`` only (the connection stays up), so a request published to that
        subject reached no one and its caller would wait out its whole timeout. Every
        waiter on exactly that subject fails now with :class:`PublishDenied`."""
        m = _DENIED_RE.search(err_msg)
        if m is not None:
            self._denied(m.group(1).lower(), m.group(2))
        await super()._process_err(err_msg)

    def _denied(self, what: str, lowered: str) -> None:
        # nats-py lowercases the -ERR text; its parser calls _process_err before it
        # consumes the line, so the subject's own case is still in its buffer
        buf = self._ps.buf
        raw = _DENIED_RE.search(bytes(buf[: buf.find(b"\r\n")]).decode(errors="replace"))
        if raw is not None and raw.group(1).lower() == what and raw.group(2).lower() == lowered:
            subject = _unquoted(raw.group(2))

            def same(s: str) -> bool:
                return s == subject
        else:  # not found (another nats-py): the best left is a case-blind match
            subject = _unquoted(lowered)

            def same(s: str) -> bool:
                return s.lower() == lowered

        if what == TO:
            self.denied.pop(subject, None)
            self.denied[subject] = time.time()
            while len(self.denied) > _DENIED_KEEP:
                del self.denied[next(iter(self.denied))]
            log.debug("nats: publish to %s refused: permissions violation", subject)
            hit = [w for s in self._asked if same(s) for w in self._asked[s]]
        else:  # the reply subject was refused: the waiters that gave it
            log.debug("nats: publish with reply %s refused: a reserved reply subject", subject)
            hit = [w for ws in self._asked.values() for w in ws if same(w.reply)]
        for w in hit:
            w.fail(PublishDenied(w.subject, w.reply if what == REPLY else ""))
        if self.on_denied is not None:
            self.on_denied(what, same)

    async def _send_ping(self, future: asyncio.Future[Any] | None = None) -> None:
        """nats-py's own, after writing the commands still queued: nats-py (2.16) writes
        the PING straight to the socket, ahead of a SUB or PUB its flusher task has not
        written yet, so ``subscribe(); flush()`` could return before the server had the
        subscription (a request sent next: "no responders")."""
        if self._pending_data_size > 0 and self.is_connected and self._transport is not None:
            self._transport.writelines(self._pending[:])  # as the flusher task does
            self._pending = []
            self._pending_data_size = 0
        await super()._send_ping(future)

    async def _process_pong(self) -> None:
        """nats-py's own, but a PONG whose ``flush`` already timed out is consumed
        quietly. nats-py (2.16) cancels a timed-out flush's future and leaves it queued;
        the PONG that comes later (the server was stopped, or slow) then raised
        ``InvalidStateError`` in its read loop, which ends the loop without a reconnect:
        the process read nothing from the bus again, its connection still open (seen
        here: both ranks deaf for good after a nats-server SIGSTOP during a commit,
        whose bus barrier is a flush with a timeout). PONGs come in PING order, so this
        PONG is that flush's, and the next waiting one stays in line."""
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        """nats-py's own parse of a header block (the one its newer versions call:
        ``Name: Value`` per line; a name that is not ASCII or holds whitespace is
        skipped; values stripped, decoded with ``errors="replace"``), the same result,
        but a name's whitespace found by one regex search, not a generator over its
        characters: ≈ 3× cheaper. Every rollbus message carries one or two headers; a
        ``status?fresh`` at tp=4 has the engine parse eight."""
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            if _SPACE.search(key):  # the characters str.isspace() says are whitespace
                continue
            out[key] = value.strip().decode("utf-8", "replace")
        return out


_SPACE = re.compile(r"\s")


RANK = "Rollbus-Rank"
# when the caller stops waiting: absolute unix epoch milliseconds (see deadline_header)
DEADLINE = "Rollbus-Deadline"
STATUS = "Status"

Handler = Callable[[bytes, dict[str, str]], Awaitable[bytes | None]]
BATCH_TOKEN = "batch"  # the reply token of a batch of stream replies (never a _token())
BatchItem = tuple[str, str, bytes]  # (reply token, request id, the reply's data)
_batch_decoder = msgspec.msgpack.Decoder(list[BatchItem])
_batch_encoder = msgspec.msgpack.Encoder()
JS_HEADERS = ("Nats-Stream", "Nats-Sequence")


def deadline_header(timeout: float, now: float | None = None) -> str:
    """The ``Rollbus-Deadline`` value of a request whose caller waits ``timeout`` seconds
    from ``now`` (unix epoch seconds, default the wall clock): epoch milliseconds. Wall
    clock, not monotonic: the serving process compares it with its own clock (same host,
    or NTP-synced hosts; README Bus contract)."""
    at = time.time() if now is None else now
    return str(int((at + max(0.0, timeout)) * 1000))


def unreadable_deadline(headers: dict[str, str]) -> str:
    """Why the ``Rollbus-Deadline`` of ``headers`` cannot be read ("" when there is none
    or it is epoch milliseconds)."""
    raw = headers.get(DEADLINE)
    if raw is None:
        return ""
    try:
        int(raw.strip())
    except ValueError:
        return _unreadable(raw)
    return ""


def _unreadable(raw: str) -> str:
    return f"unreadable {DEADLINE} {raw[:32]!r}"


def _late(raw: str, now: float | None) -> tuple[bool, str]:
    """``(readable, why late)`` of a ``Rollbus-Deadline`` value, parsed once."""
    try:
        at_ms = int(raw.strip())
    except ValueError:
        return False, _unreadable(raw)
    late_ms = (time.time() if now is None else now) * 1000 - at_ms
    if late_ms > 0:
        return True, f"{late_ms / 1000:.3f}s past its caller's deadline"
    return True, ""


def past_deadline(headers: dict[str, str], now: float | None = None) -> str:
    """Why a request carrying ``headers`` must not be acted on ("" when it may): its
    caller's deadline has passed (it was already told it failed), or the deadline cannot
    be read (a deadline we cannot honour is not served either). No header: served."""
    raw = headers.get(DEADLINE)
    if raw is None:
        return ""
    return _late(raw, now)[1]


def not_a_request(msg: Msg) -> str:
    """Why ``msg``, received on a served or subscribed subject, is not a rollbus request
    or notice ("" when it is one): see the module doc."""
    reply = msg.reply or ""
    headers = msg.headers or {}
    if reply and not reply.startswith("_INBOX"):
        return f"reply subject {reply.split('.', 1)[0]}… is not an inbox"
    if reply.endswith("." + BATCH_TOKEN):  # a process's batch inbox, never one reply's
        return "reply subject is a batch inbox"
    if any(h in headers for h in JS_HEADERS):
        return "a JetStream message"
    if not reply and REQUEST_ID not in headers:
        return "neither a reply subject nor a request id"
    return ""


@dataclass
class Reply:
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)  # when it arrived


class _Gather:
    """Replies collected for one scatter, keyed by rank."""

    def __init__(self, expected: int, on_reply: Callable[[int, Reply], None] | None = None) -> None:
        self.expected = expected
        self.replies: dict[int, Reply] = {}
        self.done = asyncio.get_running_loop().create_future()
        self.on_reply = on_reply
        self.lost = False  # the connection dropped: replies not yet here never come
        self.error: ControlError | None = None  # e.g. the request's publish was refused

    def fail(self, error: ControlError | None = None) -> None:
        self.lost = True
        self.error = error
        if not self.done.done():
            self.done.set_result(None)

    def add(self, rank: int, reply: Reply) -> None:
        first = rank not in self.replies
        self.replies.setdefault(rank, reply)
        if len(self.replies) >= self.expected and not self.done.done():
            self.done.set_result(None)
        if first and self.on_reply is not None:
            self.on_reply(rank, reply)


class _Expired(Exception):
    """A request's timer fired before its reply came (see :meth:`Sent.reply`)."""


def _expire(sent: Sent) -> None:
    """``sent``'s timer fired: its future fails with :class:`_Expired`, and a fresh one
    takes its place under the same token, here in the timer's callback, so a reply the
    inbox hands over from now on (one that waited unread in the socket while this
    process was stopped) lands in it while :meth:`Sent.reply` settles; a failed future
    would have it dropped as late."""
    fut = sent.fut
    if fut.done():
        return
    late: asyncio.Future[Reply] = fut.get_loop().create_future()
    sent.fut = late
    if sent.bus._pending.get(sent.token) is fut:
        sent.bus._pending[sent.token] = late
    fut.set_exception(_Expired())


class Sent:
    """One request published by :meth:`Bus.send`, its reply still to come."""

    def __init__(self, bus: Bus, subject: str, token: str, fut: asyncio.Future[Reply]) -> None:
        self.bus, self.subject, self.token, self.fut = bus, subject, token, fut

    async def reply(self, timeout: float) -> Reply:
        """The one reply, within ``timeout`` from now; ``Timeout`` or ``NoResponders``.
        When the timer fires, the reply may be this process's own delay (stopped, or
        starved of CPU: it waits unread in the socket): :meth:`Bus.settle` first, then
        ``Timeout`` only if it is still not there."""
        # the future awaited directly under one timer (not wait_for: a waiter future and
        # a done-callback more per request); a cancelled caller cancels it, as wait_for did
        timer = asyncio.get_running_loop().call_later(timeout, _expire, self)
        try:
            return await self.fut
        except _Expired:
            await self.bus.settle()
            if self.fut.done():  # _expire's fresh future: the reply was only unread
                return self.fut.result()
            raise Timeout(self.subject, timeout) from None
        finally:
            timer.cancel()
            self.drop()

    def drop(self) -> None:
        """Forget it: a reply that still comes is dropped as unknown."""
        self.bus._pending.pop(self.token, None)
        self.bus._rids.pop(self.token, None)
        self.bus._subjects.pop(self.token, None)
        if not self.fut.done():
            self.fut.cancel()


class StreamOverflow(ControlError):
    """A streamed request's reader fell ``limit`` replies behind: its stream is dropped."""

    def __init__(self, subject: str, limit: int) -> None:
        super().__init__(
            UNAVAILABLE, f"reader too slow: more than {limit} replies on {subject} unread"
        )


class _Stream:
    """Replies of one streamed request, in arrival order, at most ``limit`` unread.

    The NATS callback never waits for a reader (that would hold up every other
    request on the connection): a reader that falls behind loses its own stream."""

    def __init__(self, subject: str, limit: int, on_overflow: Callable[[], None]) -> None:
        self.queue: asyncio.Queue[Reply | Exception] = asyncio.Queue()
        self.subject, self.limit, self.on_overflow = subject, limit, on_overflow
        self.failed = False

    def put(self, item: Reply | Exception) -> None:
        if self.failed:
            return
        if self.queue.qsize() >= self.limit:
            self.failed = True
            while not self.queue.empty():  # free what it held; the reader sees the error next
                self.queue.get_nowait()
            self.queue.put_nowait(StreamOverflow(self.subject, self.limit))
            self.on_overflow()  # after: the reader has its error whatever the hook does
            return
        self.queue.put_nowait(item)


def _why(e: BaseException, seen: list[Exception]) -> str:
    """A short reason for a failed connect: an auth refusal is named, not just its type."""
    for x in (e, *seen):
        if "authorization" in str(x).lower():
            return "authorization violation: wrong or missing credentials for this role"
    return type(e).__name__


def _jetstream_answer(data: bytes) -> bool:
    """``data`` is a JetStream publish ack or API answer (``{"stream": …, "seq": …}``,
    ``{"type": "io.nats.jetstream…"}``, ``{"error": {… "err_code" …}}``): never a reply
    of ours, which are msgpack or carry the request id."""
    head = data[:64].replace(b" ", b"")
    return head.startswith((b'{"stream":', b'{"type":"io.nats.jetstream')) or (
        head.startswith(b'{"error":') and b'"err_code"' in data[:256]
    )


def batch_subject(reply: str) -> tuple[str, str]:
    """``(subject, token)``: where a batch carrying a reply for the inbox subject
    ``reply`` goes (``<its prefix>.batch``), and the reply's token within the batch."""
    prefix, _, token = reply.rpartition(".")
    return f"{prefix}.{BATCH_TOKEN}", token


def pack_batch(items: list[BatchItem]) -> bytes:
    """One message carrying several stream replies (see the module doc)."""
    return _batch_encoder.encode(items)


BATCH_HEADROOM = 1024  # bytes of max_payload a batch leaves unused (framing, margin)


def _item_bound(item: BatchItem) -> int:
    """An upper bound of ``item``'s msgpack size (array, two str and one bin headers)."""
    token, rid, data = item
    return 4 * (len(token) + len(rid)) + len(data) + 16  # str: up to 4 UTF-8 bytes a char


def pack_batches(items: list[BatchItem], max_payload: int) -> list[bytes]:
    """``items`` as few batch messages as fit ``max_payload`` each (a NATS publish past
    it fails), in order; an item too large alone still goes alone."""
    limit = max(1024, max_payload - BATCH_HEADROOM)
    sizes = [_item_bound(i) for i in items]
    if sum(sizes) <= limit:  # the usual case: one message
        return [pack_batch(items)]
    out: list[bytes] = []
    part: list[BatchItem] = []
    size = 0
    for item, n in zip(items, sizes, strict=True):
        if part and size + n > limit:
            out.append(pack_batch(part))
            part, size = [], 0
        part.append(item)
        size += n
    if part:
        out.append(pack_batch(part))
    return out


def new_request_id() -> str:
    """128 random bits as 32 hex digits (as ``uuid4().hex``; its UUID object costs ≈ 8×
    more, and the engine makes two per ``status?fresh``)."""
    return os.urandom(16).hex()


def _token() -> str:
    """A reply-subject token: ours alone, whatever request id the caller brought."""
    return os.urandom(16).hex()


async def _abandon(nc: Any) -> None:
    """Close a client whose connect was given up: its socket now (a cancelled nats-py
    connect leaves it open, mid-handshake), then its tasks, if it got that far."""
    tr = getattr(nc, "_transport", None)
    if tr is not None:
        with contextlib.suppress(Exception):
            tr.close()
    if nc.is_connected or nc.is_reconnecting:
        with contextlib.suppress(Exception):
            await asyncio.shield(nc.close())


class Bus:
    def __init__(self, nc: Client, name: str) -> None:
        self.nc = nc
        self.name = name
        self.url = ""
        self._inbox_prefix = nc.new_inbox()
        self._pending: dict[str, asyncio.Future[Reply] | _Gather | _Stream] = {}
        self._services: list[Service] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.dropped_replies = 0
        self.dropped_requests = 0  # messages on served subjects that are no request
        # requests that arrived after their caller's deadline (Rollbus-Deadline): never run
        self.expired_requests = 0
        self._rids: dict[str, str] = {}  # reply token -> the request id it was sent with
        self._subjects: dict[str, str] = {}  # reply token -> the subject it was sent on
        self.lost_connections = 0
        # the API (the edge) answers 503 at once while NATS is away; the engine's own
        # requests (e.g. a rollback after a failed commit) wait in nats-py's buffer and
        # go out once it has reconnected
        self.fail_when_disconnected = False
        self.callback_errors: dict[str, int] = {}  # by subject, see shared.tasks.guarded
        self._late_log = RateLimited(log)
        self._inbox: Any = None  # the reply inbox's nats-py subscription (see settle)
        # a settle whose PING is not sent yet: timers firing meanwhile share it
        self._settling: asyncio.Task[None] | None = None
        self._settles: set[asyncio.Task[None]] = set()
        # the PONG waits of settles under way: a lost connection ends them (its PONG
        # never comes: nats-py drops its future at the reconnect)
        self._pong_waits: set[asyncio.Timeout] = set()
        if isinstance(nc, _Client):
            nc.on_denied = self._publish_denied

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls, url: str, name: str, timeout: float = 5.0, tls: ssl.SSLContext | None = None
    ) -> Bus:
        """Connect within ``timeout`` seconds or raise :class:`BusUnreachable` naming ``url``.

        ``url`` may carry a role's credentials (``nats://engine:PASSWORD@host:port``); the
        reply inboxes then use that role's prefix (``_INBOX_engine``), the only inboxes its
        permissions let it read. ``tls`` defaults to the ``ROLLBUS_NATS_TLS_*`` settings.
        Passwords never appear in errors or in :attr:`url` (see :mod:`shared.creds`).
        """

        seen: list[Exception] = []  # the reason a bounded connect gave up (auth refused...)
        # A refused login is not transient (the server's users change only at a restart):
        # the connect ends at once instead of retrying until ``timeout``.
        refused = asyncio.Event()

        async def _quiet(e: Exception) -> None:
            seen.append(e)
            del seen[:-8]
            if not holder and "authorization" in str(e).lower():
                refused.set()
            # connection trouble is retried by nats-py; anything else is a bug in a callback
            if isinstance(e, (nats.errors.Error, OSError, TimeoutError)):
                log.debug("nats: %r", e)
            else:
                log.error("nats callback error: %r", e, exc_info=e)

        holder: list[Bus] = []

        async def _disconnected() -> None:
            if holder:
                holder[0].connection_lost()

        servers = [u.strip() for u in url.split(",") if u.strip()]
        tls = tls or creds.client_tls_from_env()
        opts: dict[str, Any] = {"tls": tls} if tls else {}
        # seconds as floats: nats-py's hints say int, its code takes any number
        opts |= {"connect_timeout": min(2.0, timeout), "reconnect_time_wait": 0.5}
        nc = _Client()  # ours: closed below if the connect is abandoned
        connecting = asyncio.ensure_future(
            nc.connect(
                servers=servers,
                name=name,
                inbox_prefix=creds.inbox_prefix(creds.url_user(url)),
                **opts,
                max_reconnect_attempts=-1,
                error_cb=_quiet,
                disconnected_cb=_disconnected,
                pending_size=256 * 1024 * 1024,
            )
        )
        watch = asyncio.ensure_future(refused.wait())
        ok = False
        try:
            try:
                await asyncio.wait(
                    {connecting, watch}, timeout=timeout, return_when=FIRST_COMPLETED
                )
            finally:
                watch.cancel()
                if not connecting.done():  # timed out, refused, or our caller was cancelled
                    connecting.cancel()
                    await asyncio.gather(connecting, return_exceptions=True)
            if connecting.cancelled():
                stop = nats.errors.AuthorizationError() if refused.is_set() else TimeoutError()
                raise BusUnreachable(creds.redact(url), _why(stop, seen)) from None
            try:
                connecting.result()
            except (TimeoutError, OSError, nats.errors.Error) as e:
                raise BusUnreachable(creds.redact(url), _why(e, seen)) from None
            bus = cls(nc, name)
            holder.append(bus)
            bus.url = creds.public(url)  # shown by /v1/status: no credentials
            await bus._start()
            ok = True
            return bus
        finally:
            if not ok:  # given up or cancelled: nats-py leaves a cancelled handshake's
                await _abandon(nc)  # socket open, and a finished connect is ours to close

    async def _start(self) -> None:
        # nats-py: the first flush on a fresh connection can return on the handshake's
        # PONG, before the server saw what preceded it; absorb that one here, so every
        # later flush really means "the server has processed it".
        await self.nc.flush()
        # The one wildcard inbox, before any request can be made.
        self._inbox = await self.nc.subscribe(
            self._inbox_prefix + ".*", cb=guarded("replies", self._on_reply, self.callback_errors)
        )
        await self.nc.flush()

    async def close(self) -> None:
        for svc in self._services:
            try:
                await svc.stop()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        for t in list(self._tasks):
            t.cancel()
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), 5.0)
        except Exception:  # noqa: BLE001 - server gone or reconnecting: just close
            try:
                await self.nc.close()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass

    def fail_pending(self, err: Exception) -> int:
        """End every waiting request and stream now with ``err`` (a process stopping:
        its callers answer at once instead of being cut off). Returns how many."""
        n = 0
        for waiter in list(self._pending.values()):
            if isinstance(waiter, _Stream):
                waiter.queue.put_nowait(err)
            elif isinstance(waiter, asyncio.Future) and not waiter.done():
                waiter.set_exception(err)
            else:
                continue
            n += 1
        return n

    def connection_lost(self) -> None:
        """The connection to NATS dropped (nats-py reconnects by itself): a reply to a
        request sent before cannot be relied on any more (published while our inbox was
        gone, or the request itself lost), so every waiting request, scatter and stream
        fails now with a 503 saying so, instead of at its timeout."""
        self.lost_connections += 1
        for pong in list(self._pong_waits):  # their waiters hear it now, not at its bound
            if not pong.expired():  # one that fired already cannot be moved
                pong.reschedule(-1)
        for token, waiter in list(self._pending.items()):
            if isinstance(waiter, _Gather):
                waiter.fail()
                continue
            err = ConnectionLost(self._subjects.get(token, "NATS"))
            if isinstance(waiter, _Stream):
                waiter.put(err)
            elif not waiter.done():
                waiter.set_exception(err)

    def _publish_denied(self, what: str, same: Callable[[str], bool]) -> None:
        """nats-server refused a publish to a subject, or one with a reply subject
        (``what``: TO or REPLY; ``same`` tells which): every request, scatter and
        stream sent so got nowhere, so each fails now with a 403 naming the subject
        (one on another subject, or with another reply, waits on)."""
        for token, waiter in list(self._pending.items()):
            subject = self._subjects.get(token)
            if subject is None:
                continue
            reply = f"{self._inbox_prefix}.{token}"
            if not same(subject if what == TO else reply):
                continue
            err = PublishDenied(subject, reply if what == REPLY else "")
            if isinstance(waiter, _Gather):
                waiter.fail(err)
            elif isinstance(waiter, _Stream):
                waiter.put(err)
            elif not waiter.done():
                waiter.set_exception(err)

    @property
    def denied(self) -> dict[str, float]:
        """Subjects the server refused this connection's publishes to, with the wall time
        of the latest refusal (the latest 64)."""
        return dict(getattr(self.nc, "denied", {}))

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (its INFO's ``max_payload``)."""
        return int(self.nc.max_payload)

    @property
    def pending(self) -> int:
        """Requests waiting for replies now (0 when idle: nothing leaks)."""
        return len(self._pending)

    def counts(self) -> dict[str, int]:
        """This bus's counters as ``/v1/status`` shows them (engine and API alike):
        requests waiting for replies (``pending``, 0 when idle), late or unknown replies
        dropped (``dropped``), messages on a served subject dropped as no request
        (``dropped_requests``: a bare publish, a forged reply subject) and requests
        dropped unrun past their caller's deadline (``expired``)."""
        return {
            "pending": self.pending,
            "dropped": self.dropped_replies,
            "dropped_requests": self.dropped_requests,
            "expired": self.expired_requests,
        }

    # ------------------------------------------------------------------ replies

    async def _on_reply(self, msg: Msg) -> None:
        rid = msg.subject.rsplit(".", 1)[-1]
        if rid == BATCH_TOKEN:
            self._on_batch(msg)
            return
        headers = dict(msg.headers or {})
        waiter = self._pending.get(rid)
        if waiter is None:
            self.dropped_replies += 1
            log.debug("dropped late/unknown reply %s", rid)
            return
        no_responders = headers.get(STATUS) == "503" and not msg.data
        got = headers.get(REQUEST_ID)
        if (got and got != self._rids.get(rid)) or (not headers and _jetstream_answer(msg.data)):
            # not our responder's answer (ours echo the request id): e.g. a JetStream
            # publish ack of a stream that captured the request's subject
            self.dropped_replies += 1
            log.debug("dropped a foreign reply on %s", rid)
            return
        # a no-responders status arrives on our inbox: name the subject that was called
        called = self._subjects.get(rid, msg.subject)
        if isinstance(waiter, _Stream):
            waiter.put(NoResponders(called) if no_responders else Reply(msg.data, headers))
        elif isinstance(waiter, _Gather):
            if no_responders:
                return  # a scatter only ends on rank replies or its timeout
            try:
                rank = int(headers.get(RANK, "-1"))
            except ValueError:
                rank = -1
            if rank < 0:
                self.dropped_replies += 1
                return
            waiter.add(rank, Reply(msg.data, headers))
        elif not waiter.done():
            if no_responders:
                waiter.set_exception(NoResponders(called))
            else:
                waiter.set_result(Reply(msg.data, headers))

    def _on_batch(self, msg: Msg) -> None:
        """A batch of stream replies: each item to its own stream (the module doc)."""
        try:
            items = _batch_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.dropped_replies += 1
            log.debug("dropped a malformed reply batch on %s", msg.subject)
            return
        for token, rid, data in items:
            waiter = self._pending.get(token)
            if not isinstance(waiter, _Stream) or rid != self._rids.get(token):
                self.dropped_replies += 1  # ended meanwhile, or not ours
                continue
            try:
                waiter.put(Reply(data, {REQUEST_ID: rid}))
            except Exception:  # noqa: BLE001 - a bug (e.g. in an overflow hook): that
                # stream's alone; the batch's other items still go to their streams
                log.exception("reply batch on %s: stream %s failed", msg.subject, token)
                self.callback_errors["replies"] = self.callback_errors.get("replies", 0) + 1

    async def _send(
        self,
        subject: str,
        data: bytes,
        token: str,
        rid: str,
        extra: dict[str, str] | None,
        timeout: float | None = None,
    ) -> None:
        """Publish a request whose replies come to our inbox under ``token``; with
        ``timeout`` (how long the caller waits) it carries ``Rollbus-Deadline``, so a
        responder that gets it after the caller gave up (nats-py re-sends what it held
        while reconnecting) does not act on it."""
        if self.fail_when_disconnected and not self.nc.is_connected:
            # reconnecting: a request would wait in nats-py's buffer for the server to
            # come back, maybe past its caller's timeout; fail it now, nothing sent
            raise NotConnected(subject)
        headers = {REQUEST_ID: rid, **(extra or {})}
        if timeout is not None:
            headers[DEADLINE] = deadline_header(timeout)
        self._rids[token] = headers[REQUEST_ID]
        self._subjects[token] = subject
        await self.nc.publish(subject, data, reply=f"{self._inbox_prefix}.{token}", headers=headers)

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
        request_id: str | None = None,
    ) -> Reply:
        """Publish and wait for one reply; ``Timeout`` or ``NoResponders`` on failure."""
        sent = await self.send(
            subject, data, headers=headers, request_id=request_id, timeout=timeout
        )
        return await sent.reply(timeout)

    async def send(
        self,
        subject: str,
        data: bytes,
        *,
        headers: dict[str, str] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Sent:
        """Publish a request now and wait for its reply later (:meth:`Sent.reply`), so a
        caller can have several out at once; messages go out in the order sent. A
        :class:`Sent` not waited for must be dropped (:meth:`Sent.drop`). ``timeout``:
        how long the caller will wait from now, sent as ``Rollbus-Deadline`` (none: no
        deadline, e.g. a step, which every rank must run alike)."""
        token = _token()
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[token] = fut  # registered before the publish
        sent = Sent(self, subject, token, fut)
        try:
            await self._send(subject, data, token, request_id or token, headers, timeout)
        except BaseException:
            sent.drop()
            raise
        return sent

    async def scatter(
        self,
        subject: str,
        data: bytes,
        *,
        expected: int,
        timeout: float,
        headers: dict[str, str] | None = None,
        request_id: str | None = None,
        on_reply: Callable[[int, Reply], None] | None = None,
    ) -> dict[int, Reply]:
        """Publish once; wait for one reply from each of ranks ``0..expected-1``.

        Raises :class:`Timeout` naming the missing ranks; the replies that did arrive are
        in its ``result["replies"]``. ``on_reply(rank, reply)`` is called as each rank's
        reply arrives (in the reply callback: it must not block).
        """
        token = _token()
        gather = _Gather(expected, on_reply)
        self._pending[token] = gather
        try:
            await self._send(subject, data, token, request_id or token, headers, timeout)
            # the gather's own future, awaited directly (no shield, no wait_for: each
            # costs a loop turn and futures per scatter): at the timeout it is cancelled,
            # which only this call sees (it is dropped from _pending below)
            async with asyncio.timeout(timeout):
                await gather.done
            if gather.error is not None:
                raise gather.error
            if not gather.lost or len(gather.replies) >= expected:
                return gather.replies
            raise TimeoutError  # the connection dropped: the missing ranks are named
        except TimeoutError:
            if not gather.lost and len(gather.replies) < expected:
                # the gather stays registered, so replies still come into it: those
                # only unread (this process was the late one) are in after the settle
                await self.settle()
            missing = [r for r in range(expected) if r not in gather.replies]
            if not missing:  # the last replies were only unread, or came as the timer fired
                return gather.replies
            err = Timeout(subject, timeout, missing)
            if gather.lost:
                err = Timeout(subject, timeout, missing, lost=True)
            err.result = {"missing_ranks": missing, "replies": gather.replies}
            raise err from None
        finally:
            self._pending.pop(token, None)
            self._rids.pop(token, None)
            self._subjects.pop(token, None)

    async def stream(
        self,
        subject: str,
        data: bytes,
        *,
        idle_timeout: float,
        headers: dict[str, str] | None = None,
        request_id: str | None = None,
        max_unread: int = 4096,
        on_overflow: Callable[[], None] = lambda: None,
    ) -> AsyncIterator[Reply]:
        """Publish once; yield every reply until the caller stops iterating.

        ``idle_timeout`` bounds the silence between two replies (the responder sends
        heartbeats while a request waits), raising :class:`Timeout`. More than
        ``max_unread`` replies not yet taken raise :class:`StreamOverflow` (and call
        ``on_overflow`` right away: the reader may be blocked elsewhere).
        """
        token = _token()
        stream = _Stream(subject, max_unread, on_overflow)
        self._pending[token] = stream  # registered before the publish
        try:
            # the first reply (a heartbeat) is due within idle_timeout: past it, gone
            await self._send(subject, data, token, request_id or token, headers, idle_timeout)
            while True:
                try:  # a reply already there (a step's replies come together): no timer
                    item = stream.queue.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        async with asyncio.timeout(idle_timeout):  # no task per reply
                            item = await stream.queue.get()
                    except TimeoutError:
                        item = await self._after_silence(stream, subject, idle_timeout)
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self._pending.pop(token, None)
            self._rids.pop(token, None)
            self._subjects.pop(token, None)

    async def _after_silence(self, stream: _Stream, subject: str, idle: float) -> Reply | Exception:
        """A stream's idle timer fired: its next reply, if it was only unread (seen: an
        API SIGSTOPped for 10 s told every client `engine: no answer for 6s` while the
        engine's tokens sat in its socket), else :class:`Timeout` (:meth:`settle`)."""
        await self.settle()
        try:
            return stream.queue.get_nowait()
        except asyncio.QueueEmpty:
            raise Timeout(subject, idle) from None

    async def settle(self) -> None:
        """Every reply the server sent this process before now is handed to its waiter.

        For a reply timer that fired: the silent one may be this process (stopped, or
        starved of CPU). The replies then wait in its socket, and asyncio runs the due
        timer in the same loop turn as the socket's read event, before nats-py's read
        task has parsed them: without this, a caller blames its peer for its own delay
        (an engine stopped past its scatter rolled back an update every rank had made).
        A PING/PONG with the server settles it: the server sends in order, so what it
        sent before the PONG has been parsed once the flush returns; then the inbox's
        callback hands it over (its queue drained, at most ``SILENCE_GRACE_S``).

        Cost on a real silence: one round trip (plus draining a busy inbox, ≤ 0.25 s);
        at most ``SETTLE_PONG_S + SILENCE_GRACE_S`` (~1.25 s) when the server does not
        answer (stopped: silent too). Nothing when not connected (a lost connection
        has failed every waiter already), and a connection lost meanwhile ends it at
        once (:meth:`connection_lost`). Timers that fire together share one PING.
        Never raises but for its caller's cancellation."""
        if not self.nc.is_connected:
            return
        if self._settling is None:
            task = asyncio.get_running_loop().create_task(self._settle_once())
            self._settling = task
            self._settles.add(task)  # held: a task only shielded may be collected
            task.add_done_callback(self._settles.discard)
        await asyncio.shield(self._settling)

    async def _settle_once(self) -> None:
        self._settling = None  # the PING goes out now: a timer firing later needs its own
        try:
            # bounded here too: nats-py's flush timer starts only once its PING is queued
            # for the flusher (1024 at most), and that waits while the flusher sits in a
            # full socket's drain (a stopped server): settles past that had no timer
            async with asyncio.timeout(SETTLE_PONG_S) as pong:
                self._pong_waits.add(pong)
                try:
                    await self.nc.flush(timeout=SETTLE_PONG_S)
                finally:
                    self._pong_waits.discard(pong)
            queue = getattr(self._inbox, "_pending_queue", None)  # nats-py's, per callback sub
            if queue is not None:
                async with asyncio.timeout(SILENCE_GRACE_S):
                    await queue.join()  # every message queued before is through its callback
        except (TimeoutError, OSError, nats.errors.Error):
            pass  # no answer in time: the waiters' timeouts stand

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> None:
        """Publish; a notice (not a reply into an inbox) carries a ``Rollbus-Request-Id``
        (a receiver drops a message with neither a reply subject nor an id: see
        :func:`not_a_request`)."""
        if not subject.startswith("_INBOX") and (not headers or REQUEST_ID not in headers):
            headers = {REQUEST_ID: new_request_id(), **(headers or {})}
        await self.nc.publish(subject, data, headers=headers)

    def _foreign(self, msg: Msg, subject: str) -> bool:
        why = not_a_request(msg)
        if why:
            self.dropped_requests += 1
            log.debug("dropped a message on %s: %s", subject, why)
        return bool(why)

    def _expired(self, msg: Msg, subject: str) -> bool:
        """``msg`` came after its caller's deadline: dropped and counted, never run (its
        caller was already answered that it failed; acting now would make that a lie).
        An unreadable deadline is not dropped: its caller still waits, and the handler
        answers it 400 naming the header (see :func:`unreadable_deadline`)."""
        raw = (msg.headers or {}).get(DEADLINE)
        if raw is None:
            return False
        readable, why = _late(raw, None)  # one parse (it ran three before)
        if not readable:
            return False
        if why:
            self.expired_requests += 1
            # rare (a NATS stall or outage) and worth an operator's eye: a warning, but
            # a client sending stale deadlines on purpose must not flood the log
            self._late_log.warning(subject, "dropped a request on %s, not run: %s", subject, why)
        return bool(why)

    async def flush(self, timeout: float = 5.0) -> None:
        await self.nc.flush(timeout=int(max(1, timeout)))

    # ------------------------------------------------------------------ serving

    async def add_service(
        self,
        name: str,
        version: str,
        description: str = "",
        metadata: dict[str, str] | None = None,
    ) -> Service:
        svc = Service(
            self.nc,
            ServiceConfig(name=name, version=version, description=description, metadata=metadata),
        )
        # nats micro answers `$SRV.PING/INFO/STATS` into whatever reply subject the caller
        # names, with this process's publish permissions (the engine's: events, its KV,
        # `worker.>`): only into an inbox, like every other request (the module doc)
        for verb in ("ping", "info", "stats"):
            attr = f"_handle_{verb}_request"
            setattr(svc, attr, self._inbox_only(getattr(svc, attr), f"$SRV.{verb.upper()}"))
        await svc.start()
        self._services.append(svc)
        return svc

    def _inbox_only(
        self, handler: Callable[[Msg], Awaitable[None]], subject: str
    ) -> Callable[[Msg], Awaitable[None]]:
        async def only_inbox(msg: Msg) -> None:
            if not self._foreign(msg, subject):
                await handler(msg)

        return only_inbox

    async def serve(
        self,
        service: Service,
        endpoint: str,
        subject: str,
        handler: Handler,
        *,
        queue: str,
        reply_headers: dict[str, str] | None = None,
        concurrent: bool = False,
        deadline: bool = False,
    ) -> None:
        """Answer requests on ``subject`` with ``handler(data, headers) -> reply bytes``.

        The reply echoes ``Rollbus-Request-Id`` and adds ``reply_headers`` (e.g. the
        rank). ``concurrent`` runs each request in its own task, so one slow call does
        not hold back the next message of the same subject. ``deadline``: a request past
        its ``Rollbus-Deadline`` is dropped unanswered before ``handler`` runs; one whose
        deadline is unreadable reaches ``handler``, which must refuse it (400).
        """

        async def handle(req: Request) -> None:
            if self._foreign(req._msg, subject):
                return
            if deadline and self._expired(req._msg, subject):
                return
            headers = dict(req.headers or {})
            out = await handler(req.data, headers)
            if out is None or not req._msg.reply:
                return
            h = dict(reply_headers or {})
            rid = headers.get(REQUEST_ID)
            if rid is not None and len(rid.encode()) <= MAX_REQUEST_ID_BYTES:
                h[REQUEST_ID] = rid
            await req.respond(out, headers=h)

        run = guarded(subject, handle, self.callback_errors)

        async def on_request(req: Request) -> None:
            if concurrent:
                task = asyncio.create_task(run(req))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                try:
                    await handle(req)
                except Exception:
                    # logged and counted here; nats micro then answers the caller a 500
                    log.exception("handler of %s failed", subject)
                    self.callback_errors[subject] = self.callback_errors.get(subject, 0) + 1
                    raise

        await service.add_endpoint(
            name=endpoint, subject=subject, handler=on_request, queue_group=queue
        )

    async def subscribe(
        self,
        subject: str,
        cb: Callable[[Msg], Awaitable[None]],
        queue: str = "",
        *,
        deadline: bool = False,
    ) -> Any:
        """``cb`` for every request or notice on ``subject``; ``deadline`` as in
        :meth:`serve`."""

        async def only_requests(msg: Msg) -> None:
            if self._foreign(msg, subject):
                return
            if deadline and self._expired(msg, subject):
                return
            await cb(msg)

        return await self.nc.subscribe(
            subject, queue=queue, cb=guarded(subject, only_requests, self.callback_errors)
        )
