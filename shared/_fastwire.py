"""The object reader's fast path: its own NATS connection, frames parsed here, chunk
payloads received straight into the destination buffer.

nats-py's protocol parser copies every byte of a 1 MiB chunk three to four times on the
way to a callback (its read buffer, a slice, ``bytes()`` of it, then our copy into the
object's buffer); on 2 shared cores that cost more than the transfer itself. Here an
:class:`asyncio.BufferedProtocol` hands the event loop a slice of the destination
``mmap`` for every chunk's payload, so the kernel copies each byte once, from the socket
into its place in the object. Only the control line, the headers and the bytes that came
in the same read as them go through a small scratch buffer.

Same server, credentials, inbox prefix and TLS settings as the nats-py connection it is
given (read from it, never from settings), and the same direct-get protocol as the
nats-py path of :func:`shared.objstore.read_object`: ``$JS.API.DIRECT.GET.<stream>`` with
``next_by_subj`` and ``batch``; the next batch is asked as soon as the *header* of a
batch's last chunk arrives (its sequence is the next batch's start), so the server has
the next batch to send while that chunk's payload is still being read: at most two
batches (``READ_BATCH`` + 1 MiB) are outstanding.

Every check of the nats-py path holds here too: the chunk subject, a growing stream
sequence, no more than the stored size, the chunk count and the size at the end. A
frame that does not parse, ``-ERR``, a refused direct get or the connection closing
mid-object end the read with :class:`~shared.objstore.ObjectReadError`; a missing chunk
(the stream has no more chunks before the object is complete) with
:class:`~shared.objstore.ObjectCorrupt`. :func:`connect` returns None when it cannot
connect (an auth method it does not speak, a websocket URL, a refused handshake): the
caller then reads through nats-py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client

from shared.bus import REPLY, refusal
from shared.errors import PublishDenied
from shared.objstore import ObjectCorrupt, ObjectReadDenied, ObjectReadError

log = logging.getLogger("rollbus.objstore")

SCRATCH = 16 << 10  # control lines and headers are read into this (grown for a big frame)
MAX_FRAME = 1 << 20  # a control line + headers, or a whole non-chunk frame, is at most this
MAX_LINE = 4096  # nats-server's default max control line
CRLF = b"\r\n"


class _Frames(asyncio.BufferedProtocol):
    """The connection's protocol: ``INFO``/``PING``/``-ERR`` and our inbox's ``HMSG``s."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.scratch = bytearray(SCRATCH)
        self.slen = 0  # bytes held in scratch
        self.crlf = False  # a payload was read: its CRLF comes next
        self.dest: memoryview | None = None  # where the current chunk's payload goes
        self.need = 0  # payload bytes still to come into dest
        self.info: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pong: asyncio.Future[None] | None = None
        self.reader: _Read | None = None
        self.error: Exception | None = None
        self.last = time.monotonic()

    # ---------------------------------------------------------------- transport side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ObjectReadError(f"connection to the server closed{f': {exc}' if exc else ''}"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.need:
            assert self.dest is not None
            return self.dest
        if self.slen == len(self.scratch):  # a frame bigger than scratch: grow it
            if len(self.scratch) >= MAX_FRAME + SCRATCH:
                self._fail(ObjectReadError("protocol error: frame too large"))
                self.slen = 0
            else:
                new = bytearray(min(2 * len(self.scratch), MAX_FRAME + SCRATCH))
                new[: self.slen] = self.scratch[: self.slen]
                self.scratch = new  # the old one may still be exported by the transport
        return memoryview(self.scratch)[self.slen :]

    def buffer_updated(self, nbytes: int) -> None:
        self.last = time.monotonic()
        if self.need:
            assert self.dest is not None
            self.dest = self.dest[nbytes:]
            self.need -= nbytes
            if self.reader is not None:
                self.reader.received(nbytes)
            if not self.need:
                self.dest = None
                self.crlf = True
                if self.reader is not None:
                    self.reader.chunk_done()
            return
        self.slen += nbytes
        try:
            self._parse()
        except (ValueError, IndexError) as e:
            self._fail(ObjectReadError(f"protocol error: {e}"))

    def eof_received(self) -> bool | None:
        return None  # close

    # ---------------------------------------------------------------- parsing

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if self.reader is not None:
            self.reader.fail(exc)
        if not self.info.done():
            self.info.set_exception(exc)
        if self.pong is not None and not self.pong.done():
            self.pong.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def _parse(self) -> None:
        buf, pos = self.scratch, 0
        while self.error is None:
            if self.crlf:
                if self.slen - pos < 2:
                    break
                if buf[pos : pos + 2] != CRLF:
                    raise ValueError("no CRLF after a payload")
                pos += 2
                self.crlf = False
            end = buf.find(CRLF, pos, self.slen)
            if end < 0:
                if self.slen - pos > MAX_LINE:
                    raise ValueError("control line too long")
                break
            line = bytes(buf[pos:end])
            body = end + 2
            if line.startswith(b"HMSG "):
                _, hlen, total = _msg_line(line)
                if hlen > MAX_FRAME:
                    raise ValueError(f"bad HMSG sizes {hlen} {total}")
                if self.slen - body < hlen:
                    break  # headers not all here yet
                hdr = _headers(bytes(buf[body : body + hlen]))
                plen = total - hlen
                dest = self.reader.chunk_dest(hdr, plen) if self.reader is not None else None
                start = body + hlen
                if dest is None:  # not a chunk (a status, or no reader): all of it here
                    if plen > MAX_FRAME:
                        raise ValueError(f"a {plen}-byte frame that is not a chunk")
                    if self.slen - start < plen:
                        break
                    pos = start + plen
                    self.crlf = True
                    continue
                have = min(plen, self.slen - start)
                dest[:have] = buf[start : start + have]
                if self.reader is not None and have:
                    self.reader.received(have)
                if have == plen:
                    pos = start + plen
                    self.crlf = True
                    if self.reader is not None:
                        self.reader.chunk_done()
                    continue
                self.dest, self.need = dest[have:], plen - have
                pos = self.slen  # the rest of this payload is received straight into dest
                break
            if line.startswith(b"MSG "):
                _, _, plen = _msg_line(line)
                if plen > MAX_FRAME:
                    raise ValueError(f"a {plen}-byte message without headers")
                if self.slen - body < plen:
                    break
                pos = body + plen
                self.crlf = True
                if self.reader is not None:
                    self.reader.fail(ObjectReadError("a message without headers on the inbox"))
                continue
            pos = body
            if line == b"PING":
                self._write(b"PONG\r\n")
            elif line == b"PONG":
                if self.pong is not None and not self.pong.done():
                    self.pong.set_result(None)
            elif line.startswith(b"INFO "):
                if not self.info.done():
                    self.info.set_result(json.loads(line[5:]))
            elif line.startswith(b"-ERR"):
                sent = self.reader.api.decode() if self.reader is not None else "CONNECT"
                self._fail(_server_error(line, sent))  # the connection is aborted now
                break
            elif line != b"+OK":
                raise ValueError(f"unknown protocol line {line[:40]!r}")
        if pos:
            rest = self.slen - pos
            buf[:rest] = buf[pos : self.slen]  # same length: allowed while exported
            self.slen = rest

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def ping(self, timeout: float) -> None:
        self.pong = asyncio.get_running_loop().create_future()
        self._write(b"PING\r\n")
        await asyncio.wait_for(self.pong, timeout)


def _server_error(line: bytes, sent: str) -> ObjectReadError:
    """What a ``-ERR`` line ends the transfer with: a refused publish (a direct get or a
    chunk the credentials may not send) named as :class:`~shared.errors.PublishDenied`
    names it (``sent``: what was published, for a refused reply subject)."""
    text = line[5:].decode(errors="replace").strip()
    refused = refusal(text)
    if refused is None:
        return ObjectReadError(f"server error: {text}")
    what, subject = refused
    denied = PublishDenied(sent, subject) if what == REPLY else PublishDenied(subject)
    return ObjectReadDenied(denied.message)


def _msg_line(line: bytes) -> tuple[list[bytes], int, int]:
    """``MSG <subj> <sid> [reply] <size>`` or ``HMSG <subj> <sid> [reply] <hlen> <size>``:
    (args, header bytes, total bytes); ValueError for a wrong arity or sizes that are not
    ``0 <= hlen <= total`` (a negative size would move the parser backwards)."""
    args = line.split()
    hmsg = line.startswith(b"HMSG ")
    if len(args) not in ((5, 6) if hmsg else (4, 5)):
        raise ValueError(f"malformed {'HMSG' if hmsg else 'MSG'} line {line[:80]!r}")
    total = int(args[-1])
    hlen = int(args[-2]) if hmsg else 0
    if not 0 <= hlen <= total or (hmsg and hlen == 0):
        raise ValueError(f"bad message sizes {hlen} {total} in {line[:80]!r}")
    return args, hlen, total


def _headers(raw: bytes) -> dict[str, str]:
    """``NATS/1.0[ code text]`` then ``Key: value`` lines; ``Status`` holds the code."""
    lines = raw.split(b"\r\n")
    if not lines[0].startswith(b"NATS/1.0"):
        raise ValueError(f"bad header block {raw[:40]!r}")
    out: dict[str, str] = {}
    status = lines[0][8:].strip()
    if status:
        code, _, desc = status.partition(b" ")
        out["Status"] = code.decode()
        out["Description"] = desc.decode(errors="replace")
    for ln in lines[1:]:
        if ln:
            k, sep, v = ln.partition(b":")
            if not sep:
                raise ValueError(f"bad header line {ln[:40]!r}")
            out[k.decode().strip()] = v.decode().strip()
    return out


class _Read:
    """One object's chunks, received into ``view`` in order (see the module doc)."""

    def __init__(
        self,
        frames: _Frames,
        name: str,
        stream: str,
        subject: str,
        inbox: str,
        view: memoryview,
        chunks: int,
        batch: int,
        on_filled: Callable[[int], None] | None,
    ) -> None:
        self.frames, self.name, self.subject, self.inbox = frames, name, subject, inbox
        self.api = f"$JS.API.DIRECT.GET.{stream}".encode()
        self.view, self.size, self.chunks, self.batch = view, len(view), chunks, batch
        self.on_filled = on_filled
        self.off = 0  # bytes placed (the next chunk's offset)
        self.filled = 0  # bytes received into place
        self.got = 0  # chunks
        self.sseq = 0  # the last chunk's stream sequence
        self.in_batch = 0  # chunks of the current batch so far
        self.asked = 0  # batches asked
        self.ended = 0  # batches ended (their end marker seen)
        self.last_chunk = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def fail(self, exc: Exception) -> None:
        if not self.done.done():
            if str(exc).startswith(f"{self.name}: "):
                self.done.set_exception(exc)
            else:
                self.done.set_exception(type(exc)(f"{self.name}: {exc}"))

    def ask(self, seq: int) -> None:
        req = json.dumps({"seq": seq, "next_by_subj": self.subject, "batch": self.batch})
        self.asked += 1
        self.frames._write(b"PUB %s %s %d\r\n%s\r\n" % (
            self.api, self.inbox.encode(), len(req), req.encode()))

    def chunk_dest(self, hdr: dict[str, str], plen: int) -> memoryview | None:
        """Where a chunk's payload goes (None: a status or an error, handled here)."""
        if self.done.done():
            return None
        status = hdr.get("Status", "")
        if status == "204":  # a batch ended: ask the next unless that was done already
            self.ended += 1
            if self.asked == self.ended and self.off < self.size:
                self.in_batch = 0
                self.ask(self.sseq + 1)
            return None
        if status == "404":
            self.fail(ObjectCorrupt(
                f"chunks missing: got {self.got} ({self.off} bytes) of {self.chunks} chunks "
                f"({self.size} bytes) before the stream ran out"))
            return None
        if status:
            self.fail(ObjectReadError(
                f"chunk read refused: {status} {hdr.get('Description', '')}".strip()))
            return None
        sseq = int(hdr.get("Nats-Sequence", 0))
        if hdr.get("Nats-Subject") != self.subject or sseq <= self.sseq:
            self.fail(ObjectReadError(f"unexpected message {sseq} on the chunk inbox"))
            return None
        if self.off + plen > self.size:
            self.fail(ObjectCorrupt(f"more than the stored size {self.size} bytes"))
            return None
        self.sseq = sseq
        self.got += 1
        self.in_batch += 1
        pending = int(hdr.get("Nats-Num-Pending", -1))
        off = self.off
        self.off += plen
        self.last_chunk = pending == 0 or self.off == self.size
        if self.last_chunk:
            if self.off != self.size:
                self.fail(ObjectCorrupt(f"got {self.off} bytes, stored size {self.size}"))
                return None
            if self.got != self.chunks:
                self.fail(ObjectCorrupt(f"got {self.got} chunks, stored {self.chunks}"))
                return None
        elif self.in_batch == self.batch and self.asked == self.ended + 1:
            self.in_batch = 0  # this batch's last chunk: ask the next one now
            self.ask(sseq + 1)
        return self.view[off : off + plen]

    def received(self, n: int) -> None:
        self.filled += n
        if self.on_filled is not None:
            self.on_filled(self.filled)

    def chunk_done(self) -> None:
        if self.filled == self.size and not self.done.done():
            self.done.set_result(None)


def _connect_opts(nc: Client, info: dict[str, Any]) -> dict[str, Any]:
    """CONNECT options, with ``nc``'s credentials (user/password, token, or the URL's)
    only when the server's ``INFO`` says ``auth_required`` (as nats-py does)."""
    opts = getattr(nc, "options", None) or {}
    uri = nc._current_server.uri  # type: ignore[union-attr]
    conn: dict[str, Any] = {
        "verbose": False, "pedantic": False, "lang": "python3", "version": "rollbus",
        "protocol": 1, "headers": True, "no_responders": True, "echo": False,
        "name": f"{opts.get('name') or 'rollbus'}-fastwire",
    }
    if not info.get("auth_required"):
        return conn
    user, password, token = opts.get("user"), opts.get("password"), opts.get("token")
    if callable(user) or callable(password) or callable(token):
        raise ValueError("credentials from a callback: not spoken here")
    if user is not None and password is not None:
        conn.update(user=user, **{"pass": password})
    elif token is not None:
        conn["auth_token"] = token
    elif uri.username is not None:
        if uri.password is None:
            conn["auth_token"] = uri.username
        else:
            conn.update(user=uri.username, **{"pass": uri.password})
    return conn


async def connect(nc: Client, timeout: float = 5.0) -> _Frames | None:
    """A second connection to ``nc``'s current server with ``nc``'s credentials and TLS,
    or None when that cannot be had (the caller uses nats-py)."""
    srv = getattr(nc, "_current_server", None)
    opts = getattr(nc, "options", None) or {}
    uri = getattr(srv, "uri", None)
    if uri is None or uri.scheme not in ("nats", "tls") or not uri.hostname:
        return None
    if getattr(nc, "_signature_cb", None) or getattr(nc, "_user_jwt_cb", None):
        return None  # nkeys / JWT: not spoken here
    loop = asyncio.get_running_loop()
    tls_ctx: ssl.SSLContext | None = None
    host = opts.get("tls_hostname") or getattr(srv, "tls_name", None) or uri.hostname
    if uri.scheme == "tls" or opts.get("tls"):
        tls_ctx = opts.get("tls") or ssl.create_default_context()  # as nats-py does
    first = bool(opts.get("tls_handshake_first")) and tls_ctx is not None
    frames: _Frames | None = None
    try:
        transport, fr = await asyncio.wait_for(
            loop.create_connection(  # handshake_first: TLS before the server's INFO
                _Frames, uri.hostname, uri.port or 4222,
                ssl=tls_ctx if first else None, server_hostname=host if first else None,
            ),
            timeout,
        )
        frames = fr
        info = await asyncio.wait_for(fr.info, timeout)
        if not first and (info.get("tls_required") or tls_ctx is not None):
            new = await asyncio.wait_for(
                loop.start_tls(transport, fr, tls_ctx or ssl.create_default_context(),
                               server_hostname=host),
                timeout,
            )
            assert new is not None
            fr.transport = new  # type: ignore[assignment]
        fr._write(b"CONNECT %s\r\n" % json.dumps(_connect_opts(nc, info)).encode())
        await fr.ping(timeout)  # the server accepted CONNECT (else -ERR closed us)
        return fr
    except (OSError, TimeoutError, ObjectReadError, ssl.SSLError, ValueError) as e:
        log.debug("fast reader: cannot connect (%r); nats-py reads instead", e)
        if frames is not None and frames.transport is not None:
            frames.transport.abort()
        return None
    except BaseException:  # cancelled mid-handshake: the socket is not left open
        if frames is not None and frames.transport is not None:
            frames.transport.abort()
        raise


async def read_into(
    frames: _Frames,
    nc: Client,
    name: str,
    stream: str,
    subject: str,
    view: memoryview,
    chunks: int,
    batch: int,
    stall_timeout: float,
    on_filled: Callable[[int], None] | None = None,
) -> None:
    """Read the chunks of ``subject`` into ``view`` (exactly its size) over ``frames``;
    raises :class:`ObjectReadError` / :class:`ObjectCorrupt` as the module doc says.
    Closes the connection at the end."""
    inbox = nc.new_inbox()  # under nc's prefix: the only inboxes its role may read
    rd = _Read(frames, name, stream, subject, inbox, view, chunks, batch, on_filled)
    frames.reader = rd
    try:
        if frames.error is not None:
            raise frames.error
        frames._write(b"SUB %s 1\r\n" % inbox.encode())
        frames.last = time.monotonic()
        rd.ask(1)
        while not rd.done.done():  # watchdog: a stall ends the read
            await asyncio.wait({rd.done}, timeout=0.25)
            if not rd.done.done() and time.monotonic() - frames.last > stall_timeout:
                rd.fail(ObjectReadError(f"no data for {stall_timeout:g}s"))
        rd.done.result()
    finally:
        frames.reader = None
        if frames.transport is not None:
            frames.transport.abort()
        if frames.dest is not None:  # no slice of the caller's buffer outlives the read
            frames.dest.release()
            frames.dest, frames.need = None, 0
        view.release()


# --------------------------------------------------------------------------- writer


class Link:
    """A plain-TCP connection of the writer's own: chunk payloads go to the socket
    straight from the caller's buffer (``loop.sock_sendall`` of memoryview slices, no copy
    in user space; asyncio's transport copies whatever the socket does not take at once,
    and nats-py's publish copies every chunk twice before that). Frames from the server
    are parsed by a reader task: ``on_msg(subject, payload, status)`` for every message,
    ``PING`` answered; a closed connection, ``-ERR``, a frame that does not parse or an
    exception raised by ``on_msg`` end the link: :attr:`error` is set, ``on_close`` is
    called and the socket is shut down (a blocked :meth:`send` fails at once). A frame
    the server has not taken within :attr:`send_timeout` s (a server that stopped
    reading) ends the link the same way."""

    def __init__(self, sock: socket.socket, send_timeout: float = 30.0) -> None:
        self.sock = sock
        self.send_timeout = send_timeout
        self.lock = asyncio.Lock()  # one frame at a time on the wire
        self.on_msg: Callable[[str, bytes, str], None] = lambda s, p, st: None
        self.on_close: Callable[[Exception], None] = lambda e: None
        self.error: Exception | None = None
        self.pong: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    async def send(self, *parts: bytes | memoryview) -> None:
        loop = asyncio.get_running_loop()
        async with self.lock:
            if self.error is not None:
                raise self.error
            try:
                try:  # one syscall for the frame when the socket takes it all
                    n = self.sock.sendmsg(parts)
                except (BlockingIOError, InterruptedError):
                    n = 0
                for p in parts:  # what the kernel did not take yet
                    if n >= len(p):
                        n -= len(p)
                        continue
                    async with asyncio.timeout(self.send_timeout):  # armed only when waiting
                        await loop.sock_sendall(self.sock, memoryview(p)[n:] if n else p)
                    n = 0
            except TimeoutError:
                self._end(ObjectReadError(
                    f"the server took no data for {self.send_timeout:g}s (not reading?)"))
                raise self.error from None  # type: ignore[misc]
            except OSError as e:
                self._end(ObjectReadError(f"connection lost: {e!r}"))
                raise self.error from None  # type: ignore[misc]
            except asyncio.CancelledError:  # a frame may be half sent: nothing may follow it
                self._end(ObjectReadError("a send was cancelled"))
                raise

    async def ping(self, timeout: float) -> None:
        self.pong = asyncio.get_running_loop().create_future()
        await self.send(b"PING\r\n")
        await asyncio.wait_for(self.pong, timeout)

    def _end(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
            with contextlib.suppress(OSError):  # a send blocked on the socket fails now
                self.sock.shutdown(socket.SHUT_RDWR)
            if self.pong is not None and not self.pong.done():
                self.pong.set_exception(exc)
            self.on_close(exc)

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        buf = bytearray()
        chunk = bytearray(64 << 10)
        try:
            while True:
                n = await loop.sock_recv_into(self.sock, chunk)
                if not n:
                    raise ObjectReadError("the server closed the connection")
                buf += chunk[:n]
                pos = 0
                while True:
                    end = buf.find(CRLF, pos)
                    if end < 0:
                        if len(buf) - pos > MAX_LINE:
                            raise ObjectReadError("protocol error: control line too long")
                        break
                    line = bytes(buf[pos:end])
                    if line.startswith((b"MSG ", b"HMSG ")):
                        args, hlen, total = _msg_line(line)
                        if total > MAX_FRAME:
                            raise ObjectReadError(f"protocol error: {total}-byte frame")
                        if len(buf) - (end + 2) < total + 2:
                            break
                        body = bytes(buf[end + 2 : end + 2 + total])
                        status = _headers(body[:hlen]).get("Status", "") if hlen else ""
                        pos = end + 2 + total + 2
                        self.on_msg(args[1].decode(), body[hlen:], status)
                        continue
                    pos = end + 2
                    if line == b"PING":
                        t = asyncio.ensure_future(self.send(b"PONG\r\n"))
                        t.add_done_callback(lambda f: f.cancelled() or f.exception())
                    elif line == b"PONG":
                        if self.pong is not None and not self.pong.done():
                            self.pong.set_result(None)
                    elif line.startswith(b"-ERR"):
                        raise _server_error(line, "a chunk")
                    elif not line.startswith(b"INFO ") and line != b"+OK":
                        raise ObjectReadError(f"protocol error: {line[:40]!r}")
                del buf[:pos]
        except asyncio.CancelledError:
            self._end(ObjectReadError("connection closed"))
            raise
        except (OSError, ObjectReadError) as e:
            self._end(e if isinstance(e, ObjectReadError) else ObjectReadError(repr(e)))
        except ValueError as e:
            self._end(ObjectReadError(f"protocol error: {e}"))
        except Exception as e:  # a bug (e.g. in on_msg) ends the link loudly, never silently
            log.error("fast writer: reader failed: %r", e, exc_info=True)
            self._end(ObjectReadError(f"reader failed: {e!r}"))

    def abort(self) -> None:
        """End the link now, discarding what the kernel has not sent yet (a reset, not
        a graceful close: no frame still buffered here reaches the server later)."""
        with contextlib.suppress(OSError):  # close() then resets the connection
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._end(ObjectReadError("aborted"))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        self.sock.close()


async def link(nc: Client, timeout: float = 5.0, send_timeout: float = 30.0) -> Link | None:
    """A plain-TCP connection to ``nc``'s current server with its credentials, or None
    (TLS, nkeys/JWT, websocket, or the connection refused: the caller uses nats-py)."""
    srv = getattr(nc, "_current_server", None)
    opts = getattr(nc, "options", None) or {}
    uri = getattr(srv, "uri", None)
    if uri is None or uri.scheme != "nats" or not uri.hostname or opts.get("tls"):
        return None
    if getattr(nc, "_signature_cb", None) or getattr(nc, "_user_jwt_cb", None):
        return None
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    lk: Link | None = None
    try:
        sock = await asyncio.wait_for(loop.run_in_executor(
            None, socket.create_connection, (uri.hostname, uri.port or 4222), timeout), timeout)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray()
        while CRLF not in head:
            got = await asyncio.wait_for(loop.sock_recv(sock, 4096), timeout)
            if not got or len(head) > MAX_LINE:
                raise ObjectReadError("no INFO from the server")
            head += got
        if not head.startswith(b"INFO "):
            raise ObjectReadError("no INFO from the server")
        info = json.loads(bytes(head[5 : head.index(CRLF)]))
        if info.get("tls_required"):
            raise ObjectReadError("the server wants TLS")
        lk = Link(sock, send_timeout)
        await lk.send(b"CONNECT %s\r\n" % json.dumps(_connect_opts(nc, info)).encode())
        lk.task = asyncio.ensure_future(lk._read_loop())
        await lk.ping(timeout)  # the server accepted CONNECT (else -ERR and closed)
        return lk
    except (OSError, TimeoutError, ObjectReadError, ValueError) as e:
        log.debug("fast writer: cannot connect (%r); nats-py writes instead", e)
        await _drop(sock, lk)
        return None
    except BaseException:  # cancelled mid-handshake: no socket or reader task left behind
        await asyncio.shield(_drop(sock, lk))
        raise


async def _drop(sock: socket.socket | None, lk: Link | None) -> None:
    if lk is not None:
        await lk.close()
    elif sock is not None:
        sock.close()
