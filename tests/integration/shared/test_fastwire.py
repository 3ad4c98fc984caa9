"""The object store's own wire path (:mod:`shared._fastwire`) against a real nats-server,
with faults made by a TCP proxy between the client and the server: the fast
connection cut mid-object or fed bytes that are no frame, chunks deleted from the
stream, no second connection possible (then nats-py reads), and TLS with credentials."""

from __future__ import annotations

import asyncio
import hashlib
import os
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
    the server's stream after ``after`` bytes)."""

    def __init__(self, host: str, port: int, mode: str = "", after: int = 0) -> None:
        self.host, self.port, self.mode, self.after = host, port, mode, after
        self.count = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        idx, self.count = self.count, self.count + 1
        mode = self.mode if idx >= 1 else ""
        if mode == "refuse":
            w.close()
            return
        ur, uw = await asyncio.open_connection(self.host, self.port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
            n, done = 0, False
            try:
                while data := await src.read(1 << 16):
                    if down and mode and not done and n + len(data) > self.after:
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
            except OSError:
                pass
            finally:
                for x in (dst, w, uw):
                    x.close()

        await asyncio.gather(pipe(r, uw, False), pipe(ur, w, True))


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


async def _via(nats_url: str, mode: str = "", after: int = 0) -> tuple[Proxy, Client]:
    host, port = nats_url.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = Proxy(host, int(port), mode, after)
    nc = await nats.connect(await proxy.start(), max_reconnect_attempts=0)
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
    nats_url: str, direct: Client, mode: str
) -> None:
    """The server's side closed mid-object, or bytes that are no frame (a short or
    shifted frame): ObjectReadError, nothing returned."""
    name, _, _ = await _put(direct, 12 * MIB)
    proxy, nc = await _via(nats_url, mode, after=5 * MIB + 777)
    try:
        with pytest.raises(objstore.ObjectReadError):
            await objstore.read_object(nc, BUCKET, name, stall_timeout=3.0)
        assert proxy.count == 2 and nc.is_connected  # nats-py's connection untouched
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
        with pytest.raises(objstore.ObjectMissing):
            await objstore.get_meta(direct, BUCKET, name)
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
