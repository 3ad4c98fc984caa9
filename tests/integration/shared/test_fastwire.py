"""The object store's own wire path (:mod:`shared._fastwire`) against a real nats-server,
with faults made by a TCP proxy between the client and the server: the fast
connection cut mid-object or fed bytes that are no frame, chunks deleted from the
stream, no second connection possible (then nats-py reads), and TLS with credentials."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import mmap
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from services import natsd
from shared import _fastwire, creds, objstore
from shared.bus import Bus

BUCKET = "rollbus_fastwire"
MIB = 1 << 20


class Proxy:
    """Forwards TCP to the server. Connection 0 is nats-py's; from connection 1 on (the
    fast path's) ``mode`` applies: ``refuse`` (closed at once), ``cut`` (closed after
    ``after`` bytes from the server), ``garble`` (bytes that are no frame inserted into
    the server's stream after ``after`` bytes), ``hold`` (nothing forwarded: a server
    that never sends INFO), ``stall`` (the client's bytes no longer read after
    ``after`` of them: a server that stopped reading), ``badack`` (``inject`` sent to the
    client as the ack of its first chunk, before that chunk goes on), ``pongjunk`` (bytes
    that are no frame right after the first PONG), ``delay`` (the
    client's bytes forwarded ``after`` ms late), ``record`` (nothing but ``sent``).
    ``sent`` keeps what the fast connections sent."""

    def __init__(self, host: str, port: int, mode: str = "", after: int = 0,
                 inject: bytes = b"") -> None:
        self.host, self.port, self.mode, self.after, self.inject = host, port, mode, after, inject
        self.count = 0
        self.sent = bytearray()
        self.server: asyncio.Server | None = None
        self.stopped = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.stopped.set()
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        idx, self.count = self.count, self.count + 1
        mode = self.mode if idx >= 1 else ""
        self.writers.append(w)
        if mode == "refuse":
            w.close()
            return
        if mode == "hold":
            await self.stopped.wait()
            return
        ur, uw = await asyncio.open_connection(self.host, self.port)
        self.writers.append(uw)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
            n, done = 0, False
            try:
                while data := await src.read(1 << 16):
                    if not down and mode:
                        self.sent += data
                    if not down and mode == "delay":
                        late.put_nowait((time.monotonic() + self.after / 1000, data))
                        continue
                    if not down and mode == "badack" and not done and b"\r\nPUB " in data:
                        done = True  # the ack inbox is in the SUB line that came before
                        inbox = self.sent.split(b"SUB ", 1)[1].split(b".*", 1)[0]
                        w.write(b"MSG %s.0 1 %d\r\n%s\r\n" % (inbox, len(self.inject),
                                                                 self.inject))
                        await w.drain()
                    if not down and mode == "stall" and n + len(data) > self.after:
                        uw.write(data[: self.after - n])
                        await self.stopped.wait()  # never reads the client again
                        break
                    if down and mode == "pongjunk" and not done and b"PONG\r\n" in data:
                        done = True
                        data = data.replace(b"PONG\r\n", b"PONG\r\nXMSG junk\r\n", 1)
                    if down and mode in ("cut", "garble") and not done \
                            and n + len(data) > self.after:
                        done = True
                        k = self.after - n
                        if mode == "cut":
                            dst.write(data[:k])
                            await dst.drain()
                            break
                        data = data[:k] + b"\r\nXMSG garbage\r\n" + data[k:]
                    n += len(data)
                    dst.write(data)
                    await dst.drain()
                if not down and mode == "delay":  # a clean end: what is held goes first
                    late.put_nowait((0.0, b""))
                    await flushed.wait()
            except OSError:
                pass
            finally:
                for x in (dst, w, uw):
                    x.close()

        late: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        flushed = asyncio.Event()

        async def forward_late() -> None:  # the client's bytes, each ``after`` ms late
            with contextlib.suppress(OSError):
                while True:
                    at, data = await late.get()
                    if not data:
                        flushed.set()
                        return
                    await asyncio.sleep(at - time.monotonic())
                    uw.write(data)
                    await uw.drain()

        fwd = asyncio.ensure_future(forward_late())
        try:
            await asyncio.gather(pipe(r, uw, False), pipe(ur, w, True))
        finally:
            fwd.cancel()


@pytest.fixture
async def direct(nats_url: str) -> AsyncIterator[Client]:
    c = await nats.connect(nats_url)
    await objstore.ensure_bucket(c, BUCKET)
    yield c
    await c.close()


async def _put(nc: Client, size: int) -> tuple[str, bytes, int]:
    """A fresh object; returns (name, data, stream sequence of its first chunk)."""
    name = f"m/{uuid.uuid4().hex}"
    data = os.urandom(size)
    info = await nc.jetstream().stream_info(f"OBJ_{BUCKET}")
    await objstore.put_object(nc, BUCKET, name, data)
    return name, data, info.state.last_seq + 1


async def _via(nats_url: str, mode: str = "", after: int = 0, inject: bytes = b"",
               **kw: Any) -> tuple[Proxy, Client]:
    host, port = nats_url.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = Proxy(host, int(port), mode, after, inject)
    nc = await nats.connect(await proxy.start(), max_reconnect_attempts=0, **kw)
    return proxy, nc


def _spy_connect(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    got: list[Any] = []
    real = _fastwire.connect

    async def spy(nc: Client, timeout: float = 5.0) -> Any:
        got.append(await real(nc, timeout))
        return got[-1]

    monkeypatch.setattr(_fastwire, "connect", spy)
    return got


async def test_round_trip_on_its_own_connection(
    nats_url: str, direct: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, data, _ = await _put(direct, 9 * MIB + 4321)
    proxy, nc = await _via(nats_url)
    used = _spy_connect(monkeypatch)
    try:
        sha = hashlib.sha256(data).hexdigest()
        seen: list[int] = []
        buf = await objstore.read_object(nc, BUCKET, name, expect_sha256=sha,
                                         progress=seen.append)
        assert buf[: len(data)] == data and seen[-1] == len(data)
        assert len(used) == 1 and used[0] is not None and proxy.count == 2
        with pytest.raises(objstore.ObjectCorrupt, match="SHA-256"):
            await objstore.read_object(nc, BUCKET, name, expect_sha256="0" * 64)
        # fast=False: nats-py's connection only
        buf = await objstore.read_object(nc, BUCKET, name, fast=False)
        assert buf[: len(data)] == data and proxy.count == 3
    finally:
        await nc.close()
        await proxy.stop()


async def test_falls_back_to_nats_py_when_it_cannot_connect(
    nats_url: str, direct: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, data, _ = await _put(direct, 6 * MIB)
    proxy, nc = await _via(nats_url, "refuse")
    used = _spy_connect(monkeypatch)
    try:
        buf = await objstore.read_object(nc, BUCKET, name,
                                         expect_sha256=hashlib.sha256(data).hexdigest())
        assert buf[: len(data)] == data
        assert used == [None] and proxy.count == 2  # tried, refused, read by nats-py
        # the writer falls back the same way
        meta = await objstore.put_object(nc, BUCKET, name, data)
        assert meta.digest == hashlib.sha256(data).hexdigest() and proxy.count == 3
        buf = await objstore.read_object(direct, BUCKET, name)
        assert buf[: len(data)] == data
    finally:
        await nc.close()
        await proxy.stop()


@pytest.mark.parametrize("mode", ["cut", "garble"])
async def test_broken_stream_mid_object_is_a_read_error(
    nats_url: str, direct: Client, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's side closed mid-object, or bytes that are no frame (a short or
    shifted frame): ObjectReadError, nothing returned, the buffer unmapped at once."""
    name, _, _ = await _put(direct, 12 * MIB)
    proxy, nc = await _via(nats_url, mode, after=5 * MIB + 777)
    made: list[mmap.mmap] = []
    real = mmap.mmap

    def rec(*a: Any, **kw: Any) -> mmap.mmap:
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(mmap, "mmap", rec)
    try:
        with pytest.raises(objstore.ObjectReadError):
            await objstore.read_object(nc, BUCKET, name, stall_timeout=3.0,
                                       expect_sha256="0" * 64)
        assert proxy.count == 2 and nc.is_connected  # nats-py's connection untouched
        await _settle(lambda: made[-1].closed)  # after the update being hashed, if any
        assert len(made) == 1 and made[0].closed
    finally:
        await nc.close()
        await proxy.stop()


async def test_writer_link_cut_mid_object_fails_and_purges(
    nats_url: str, direct: Client
) -> None:
    """The writer's own connection closed by the server's side after a few acks: the put
    fails (ObjectReadError), no meta is written and the chunks sent are purged."""
    proxy, nc = await _via(nats_url, "cut", after=1500)
    name = f"m/{uuid.uuid4().hex}"
    js = direct.jetstream()
    before = (await js.stream_info(f"OBJ_{BUCKET}")).state.messages
    try:
        with pytest.raises(objstore.ObjectReadError):
            await objstore.put_object(nc, BUCKET, name, os.urandom(40 * MIB), ack_timeout=10)
        assert proxy.count == 2 and nc.is_connected
        await _not_stored(direct, name)
        assert (await js.stream_info(f"OBJ_{BUCKET}")).state.messages == before  # purged
    finally:
        await nc.close()
        await proxy.stop()


@pytest.mark.parametrize("fast", [True, False], ids=["fastwire", "nats-py"])
@pytest.mark.parametrize("which", ["middle", "last"])
async def test_lost_chunk_is_corrupt(direct: Client, fast: bool, which: str) -> None:
    name, _, first = await _put(direct, 8 * MIB + 5)  # 9 chunks
    seq = first + (3 if which == "middle" else 8)
    await direct.jetstream().delete_msg(f"OBJ_{BUCKET}", seq)
    with pytest.raises(objstore.ObjectCorrupt):
        await objstore.read_object(direct, BUCKET, name, fast=fast, stall_timeout=3.0)


async def test_tls_and_role_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TLS with the worker's credentials, as a rank reads (the writer, which does
    not speak TLS itself, goes through nats-py)."""
    from tests.integration.test_nats_tls import make_ca_and_server_cert

    ca, cert, key = make_ca_and_server_cert(tmp_path)
    users = creds.ensure(tmp_path / "creds")
    srv = natsd.start(tmp_path / "nats", port=0, users=users, tls_cert=str(cert),
                      tls_key=str(key))
    monkeypatch.setenv("ROLLBUS_NATS_TLS_CA", str(ca))
    used = _spy_connect(monkeypatch)
    engine = await Bus.connect(creds.with_creds(srv.url, *users["engine"]), "engine")
    trainer = await Bus.connect(creds.with_creds(srv.url, *users["trainer"]), "trainer")
    worker = await Bus.connect(creds.with_creds(srv.url, *users["worker"]), "worker")
    try:
        await objstore.ensure_bucket(engine.nc, "rollbus_ckpt")
        data = os.urandom(7 * MIB + 3)
        name = "tiny/tls/rank0-of-1.safetensors"
        meta = await objstore.put_object(trainer.nc, "rollbus_ckpt", name, data)
        buf = await objstore.read_object(worker.nc, "rollbus_ckpt", name,
                                         expect_sha256=meta.digest)
        assert buf[: len(data)] == data
        assert len(used) == 1 and used[0] is not None  # read on its own TLS connection
    finally:
        for b in (worker, trainer, engine):
            await b.close()
        srv.stop()


# --------------------------------------------------------------------------- failure paths


def _open_sockets_to(port: int) -> int:
    """Open client sockets of this process whose peer is ``port`` (the proxy)."""
    n = 0
    for o in gc.get_objects():
        if isinstance(o, socket.socket) and o.fileno() != -1 and o.family == socket.AF_INET:
            with contextlib.suppress(OSError):
                n += o.getpeername()[1] == port
    return n


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


async def _not_stored(direct: Client, name: str) -> None:
    """No meta was written for ``name``: the failed put left no object."""
    with pytest.raises(objstore.ObjectMissing):
        await objstore.get_meta(direct, BUCKET, name)


async def _settle(cond: Any, wait: float = 5.0) -> None:
    deadline = time.monotonic() + wait
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def test_writer_link_server_stops_reading_is_an_error(
    nats_url: str, direct: Client
) -> None:
    """The server stops reading the writer's connection mid-object: the send blocked on
    the socket ends after ``ack_timeout`` with ObjectReadError, nothing is stored."""
    proxy, nc = await _via(nats_url, "stall", after=64 << 10)  # its buffers stay small
    name = f"m/{uuid.uuid4().hex}"
    try:
        with pytest.raises(objstore.ObjectReadError, match=r"put .*: the server took no data"):
            await asyncio.wait_for(
                objstore.put_object(nc, BUCKET, name, os.urandom(32 * MIB), ack_timeout=2),
                30,  # without the bound on the send: hangs (TimeoutError here)
            )
        assert nc.is_connected
        await _not_stored(direct, name)
    finally:
        await nc.close()
        await proxy.stop()


async def test_put_whose_link_fails_after_connect_leaks_nothing(
    nats_url: str, direct: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's connection is set up, then ended by bytes that are no frame (right
    after the handshake's PONG): the put fails with ObjectReadError and its socket, its
    reader task and its SHA-256 thread are gone."""
    proxy, nc = await _via(nats_url, "pongjunk")
    links: list[Any] = []
    real = _fastwire.link

    async def spy(*a: Any, **kw: Any) -> Any:
        links.append(await real(*a, **kw))
        return links[-1]

    monkeypatch.setattr(_fastwire, "link", spy)
    tasks, threads = asyncio.all_tasks(), _threads("sha256")
    try:
        with pytest.raises(objstore.ObjectReadError, match="protocol error") as exc:
            await objstore.put_object(nc, BUCKET, f"m/{uuid.uuid4().hex}", os.urandom(8 * MIB))
        assert len(links) == 1 and links[0] is not None
        assert links[0].sock.fileno() == -1 and links[0].task.done()  # closed, not at GC
        await _settle(lambda: _threads("sha256") == threads)
        ours = [t for t in asyncio.all_tasks() - tasks
                if t.get_coro().cr_code.co_filename.endswith(  # type: ignore[union-attr]
                    ("shared/_fastwire.py", "shared/objstore.py"))]
        assert not ours and _threads("sha256") == threads
        del exc
    finally:
        await nc.close()
        await proxy.stop()


@pytest.mark.parametrize("side", ["writer", "reader"])
async def test_cancel_mid_handshake_closes_the_socket(nats_url: str, side: str) -> None:
    """Cancelled while waiting for INFO from a server that never sends it: the socket of
    the fast connection (the writer's Link, the reader's) is closed."""
    proxy, nc = await _via(nats_url, "hold")
    port = int(proxy.server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    socks = _open_sockets_to(port)
    try:
        fn = _fastwire.link if side == "writer" else _fastwire.connect
        t = asyncio.ensure_future(fn(nc))  # type: ignore[operator]
        await _settle(lambda: proxy.count == 2)
        await asyncio.sleep(0.2)
        assert _open_sockets_to(port) == socks + 1
        t.cancel()
        with pytest.raises(asyncio.CancelledError) as exc:  # its traceback keeps the frames
            await t
        await asyncio.sleep(0.05)  # an aborted transport closes its socket on the next turn
        assert _open_sockets_to(port) == socks  # closed, not left to the GC
        del exc
    finally:
        await nc.close()
        await proxy.stop()


@pytest.mark.parametrize("ack", [b'"error"', b"[]", b'{"seq": 1}'], ids=["str", "list", "noseq"])
async def test_writer_ack_that_is_not_a_pub_ack_fails_the_put(
    nats_url: str, direct: Client, ack: bytes
) -> None:
    """The ack of a chunk is not a JetStream publish ack (not a JSON object, or one without
    stream and sequence): the put fails at once with ObjectReadError, nothing is stored."""
    proxy, nc = await _via(nats_url, "badack", inject=ack)
    name = f"m/{uuid.uuid4().hex}"
    try:
        with pytest.raises(objstore.ObjectReadError, match="not a JetStream ack"):
            await objstore.put_object(nc, BUCKET, name, os.urandom(8 * MIB), ack_timeout=5)
        await _not_stored(direct, name)
    finally:
        await nc.close()
        await proxy.stop()


async def test_link_reader_exception_ends_the_link_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Any exception from ``on_msg`` ends the link (its error reaches ``on_close`` and a
    blocked sender) and is logged at ERROR, never a reader that died silently."""
    a, b = socket.socketpair()
    a.setblocking(False)
    lk = _fastwire.Link(a)
    closed: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    lk.on_close = closed.set_result

    def boom(subject: str, payload: bytes, status: str) -> None:
        raise KeyError("a bug in on_msg")

    lk.on_msg = boom
    lk.task = asyncio.ensure_future(lk._read_loop())
    try:
        b.sendall(b"MSG _INBOX.x.0 1 2\r\n{}\r\n")
        exc = await asyncio.wait_for(closed, 5)
        assert isinstance(exc, objstore.ObjectReadError) and "KeyError" in str(exc)
        assert any(r.levelname == "ERROR" and "reader failed" in r.getMessage()
                   for r in caplog.records)
        with pytest.raises(objstore.ObjectReadError):
            await lk.send(b"PING\r\n")
    finally:
        await lk.close()
        b.close()


async def test_tls_handshake_first_reads_on_its_own_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server with ``handshake_first`` (TLS before INFO): the reader's connection does
    the TLS handshake first too, instead of waiting for an INFO that never comes."""
    import ssl

    from tests.integration.test_nats_tls import make_ca_and_server_cert

    ca, cert, key = make_ca_and_server_cert(tmp_path)
    real_conf = natsd.server_config
    monkeypatch.setattr(natsd, "server_config", lambda *a, **kw: real_conf(*a, **kw).replace(
        'tls {"cert_file"', 'tls {"handshake_first": true, "cert_file"'))
    srv = natsd.start(tmp_path / "nats", port=0, tls_cert=str(cert), tls_key=str(key))
    used = _spy_connect(monkeypatch)
    ctx = ssl.create_default_context(cafile=str(ca))
    nc = await nats.connect(srv.url, tls=ctx, tls_handshake_first=True)
    try:
        await objstore.ensure_bucket(nc, BUCKET)
        name, data, _ = await _put(nc, 6 * MIB)
        buf = await objstore.read_object(nc, BUCKET, name,
                                         expect_sha256=hashlib.sha256(data).hexdigest())
        assert buf[: len(data)] == data
        assert len(used) == 1 and used[0] is not None  # its own TLS connection
    finally:
        await nc.close()
        srv.stop()


async def test_failed_put_leaves_no_chunk_behind_its_purge(nats_url: str, direct: Client) -> None:
    """A put that fails with chunks still on their way (here held 0.6 s by the proxy)
    waits for their acks before it purges: no chunk of it is stored after the purge."""
    proxy, nc = await _via(nats_url, "delay", after=600)
    data = os.urandom(16 * MIB)
    js = direct.jetstream()
    before = (await js.stream_info(f"OBJ_{BUCKET}")).state.messages

    async def ready(n: int) -> None:
        if n > 10 * MIB:
            raise RuntimeError("the fill failed")

    async def digest() -> str:
        return hashlib.sha256(data).hexdigest()

    try:
        with pytest.raises(RuntimeError, match="fill failed"):
            await objstore.put_object(nc, BUCKET, f"m/{uuid.uuid4().hex}", data,
                                      ready=ready, digest=digest)
        await asyncio.sleep(1.5)  # anything still held by the proxy has landed by now
        assert (await js.stream_info(f"OBJ_{BUCKET}")).state.messages == before
    finally:
        await nc.close()
        await proxy.stop()


async def test_credentials_only_when_the_server_asks(nats_url: str, direct: Client) -> None:
    """A server without auth (its INFO says no ``auth_required``): the fast connections
    send no credentials, though the client has some (as nats-py does)."""
    host, port = nats_url.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = Proxy(host, int(port), "record")
    url = (await proxy.start()).replace("//", "//someone:secret@")
    nc = await nats.connect(url, max_reconnect_attempts=0)
    try:
        name = f"m/{uuid.uuid4().hex}"
        data = os.urandom(6 * MIB)
        await objstore.put_object(nc, BUCKET, name, data)  # the writer's Link
        buf = await objstore.read_object(nc, BUCKET, name)  # the reader's connection
        assert buf[: len(data)] == data and proxy.count == 3
        assert proxy.sent.count(b"CONNECT ") == 2 and b"secret" not in proxy.sent
    finally:
        await nc.close()
        await proxy.stop()
