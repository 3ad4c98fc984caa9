"""Our object-store reader and writer against a real nats-server."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from services import natsd
from shared import objstore
from shared.messages import VersionPublished

BUCKET = "rollbus_test"
MIB = 1 << 20


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    c = await nats.connect(nats_url)
    await objstore.ensure_bucket(c, BUCKET)
    yield c
    await c.close()


async def test_round_trip_multi_mib_with_and_without_digest(nc: Client) -> None:
    data = os.urandom(24 * MIB + 12345)  # not a multiple of the chunk size
    name = f"m/{uuid.uuid4().hex}/rank0-of-2.safetensors"
    seen: list[int] = []
    meta = await objstore.put_object(nc, BUCKET, name, data, seen.append)
    assert meta.size == len(data) and meta.chunks == 25 and seen[-1] == len(data)
    sha = hashlib.sha256(data).hexdigest()
    assert meta.digest == sha == (await objstore.get_meta(nc, BUCKET, name)).digest
    for expect in (None, sha):
        buf = await objstore.read_object(nc, BUCKET, name, expect_size=len(data),
                                         expect_sha256=expect)
        assert buf[: len(data)] == data
    # the standard layout: stock nats-py reads what we wrote
    stock = await nc.jetstream().object_store(BUCKET)
    assert (await stock.get(name)).data == data


@pytest.mark.parametrize("fast", [True, False])
async def test_gathered_chunks_from_several_buffers(nc: Client, fast: bool) -> None:
    """``gather``: each chunk is sent as parts taken from other memory than ``data`` (here
    a chunk straddles two buffers), over our own link and through nats-py; the object is
    their concatenation. A gather of the wrong length fails the put before it is sent."""
    head, tail = os.urandom(5 * MIB + 7), os.urandom(3 * MIB + 11)
    whole = head + tail
    placeholder = bytearray(len(whole))  # only its size counts

    def gather(a: int, b: int) -> list[memoryview]:
        out = []
        if a < len(head):
            out.append(memoryview(head)[a : min(b, len(head))])
        if b > len(head):
            out.append(memoryview(tail)[max(a, len(head)) - len(head) : b - len(head)])
        return out

    async def digest() -> str:
        return hashlib.sha256(whole).hexdigest()

    name = f"g/{uuid.uuid4().hex}"
    meta = await objstore.put_object(nc, BUCKET, name, placeholder, gather=gather,
                                     digest=digest, fast=fast)
    got = await objstore.read_object(nc, BUCKET, name, expect_sha256=meta.digest)
    assert bytes(got[: meta.size]) == whole and meta.digest == hashlib.sha256(whole).hexdigest()
    with pytest.raises(ValueError, match="needs? digest"):
        await objstore.put_object(nc, BUCKET, f"{name}.x", placeholder, gather=gather)
    with pytest.raises(ValueError, match="gave"):
        await objstore.put_object(nc, BUCKET, f"{name}.y", placeholder, digest=digest,
                                  gather=lambda a, b: gather(a, b)[:1], fast=fast)
    with pytest.raises(objstore.ObjectMissing):
        await objstore.get_meta(nc, BUCKET, f"{name}.y")


async def test_overwrite_purges_old_chunks_and_reads_new(nc: Client) -> None:
    name = f"m/{uuid.uuid4().hex}/x"
    await objstore.put_object(nc, BUCKET, name, b"a" * (3 * MIB))
    await objstore.put_object(nc, BUCKET, name, b"b" * (2 * MIB))
    buf = await objstore.read_object(nc, BUCKET, name)
    assert len(buf) == 2 * MIB and buf[:] == b"b" * (2 * MIB)


async def test_digest_and_size_mismatch_and_unknown(nc: Client) -> None:
    name = f"m/{uuid.uuid4().hex}/y"
    data = os.urandom(3 * MIB)
    await objstore.put_object(nc, BUCKET, name, data)
    with pytest.raises(objstore.ObjectCorrupt, match="SHA-256"):
        await objstore.read_object(nc, BUCKET, name, expect_sha256="0" * 64)
    with pytest.raises(objstore.ObjectCorrupt, match="size"):
        await objstore.read_object(nc, BUCKET, name, expect_size=len(data) + 1)
    with pytest.raises(objstore.ObjectMissing):
        await objstore.read_object(nc, BUCKET, f"m/{uuid.uuid4().hex}/nothing")


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("where", [0, 5 * MIB + 1, -1])
async def test_one_corrupt_byte_fails_the_verified_read(nc: Client, fast: bool,
                                                        where: int) -> None:
    """The chunk-by-chunk hash covers every byte, the last short chunk's too: one byte
    stored wrong (first, mid-object, last) fails a verified read on both paths; the same
    object read without verification comes back as stored."""
    good = os.urandom(9 * MIB + 3)  # fast path size, a short last chunk
    bad = bytearray(good)
    bad[where] ^= 0x01
    name = f"m/{uuid.uuid4().hex}/rank0-of-2.safetensors"
    await objstore.put_object(nc, BUCKET, name, bad)
    with pytest.raises(objstore.ObjectCorrupt, match="SHA-256"):
        await objstore.read_object(nc, BUCKET, name, expect_size=len(good),
                                   expect_sha256=hashlib.sha256(good).hexdigest(), fast=fast)
    buf = await objstore.read_object(nc, BUCKET, name, fast=fast)
    assert buf[:] == bad


async def test_version_stream_dedup_and_order(nc: Client) -> None:
    model = f"Qwen2.5-{uuid.uuid4().hex[:6]}"  # a '.' in the id: escaped subject token
    await objstore.ensure_ckpt_stream(nc, model)
    seqs = []
    for v in ("a", "b", "a", "c"):
        seqs.append(await objstore.publish_version(nc, VersionPublished(model, v, 2)))
    assert seqs[2] == seqs[0] and seqs[0] < seqs[1] < seqs[3]  # deduplicated by msg id
    listed = await objstore.list_versions(nc, model)
    assert [(s, e.version) for s, e in listed] == [(seqs[0], "a"), (seqs[1], "b"), (seqs[3], "c")]
    assert await objstore.list_versions(nc, model + "-none") == []


async def test_events_of_versions_no_rank_can_load_are_skipped(nc: Client) -> None:
    """A hand-made event whose version is not a valid name (empty, ``a/b``, ``..``, a
    control character) is not a version: counted, it stayed the newest forever (the
    default of ``update_weights``, a staleness bound that could never be met)."""
    model = f"m-{uuid.uuid4().hex[:6]}"
    await objstore.ensure_ckpt_stream(nc, model)
    for v in ("ok1", "", "a/b", "..", "x\ny", "ok2"):  # as `nats pub` would, no SDK check
        await objstore.publish_version(nc, VersionPublished(model, v, 2))
    listed = await objstore.list_versions(nc, model)
    assert [e.version for _, e in listed] == ["ok1", "ok2"]
    seen: list[str] = []

    async def on_event(seq: int, ev: VersionPublished) -> None:
        seen.append(ev.version)

    sub = await objstore.watch_versions(nc, model, on_event)
    try:
        for _ in range(100):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the four bad ones would have come between
    finally:
        await sub.unsubscribe()
    assert seen == ["ok1", "ok2"]


def _nats_server(store: Path, port: int) -> subprocess.Popen[bytes]:
    # the binary directly: natsd.start refuses a port still in TIME_WAIT
    return subprocess.Popen(
        [natsd.find_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_server_restart_mid_read_fails_cleanly(tmp_path: Path) -> None:
    """A NATS restart mid-pull ends the read with an error, never partial bytes."""
    from tests.e2e.stack import free_port

    port = free_port()
    server = _nats_server(tmp_path, port)
    try:
        c = None
        for _ in range(100):
            try:
                c = await nats.connect(f"nats://127.0.0.1:{port}", reconnect_time_wait=0.2,
                                       max_reconnect_attempts=-1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.05)
        assert c is not None
        await objstore.ensure_bucket(c, BUCKET)
        data = os.urandom(64 * MIB)
        await objstore.put_object(c, BUCKET, "big", data)
        restarted = asyncio.Event()

        def restart(n: int) -> None:
            # the first chunks arrived: restart the server under the reader
            nonlocal server
            if not restarted.is_set():
                restarted.set()
                server.terminate()
                server.wait()
                server = _nats_server(tmp_path, port)

        with pytest.raises(objstore.ObjectReadError):
            await objstore.read_object(c, BUCKET, "big", progress=restart, stall_timeout=2.0)
        assert restarted.is_set()
        # after the restart (JetStream recovers its store) the object is intact
        sha = hashlib.sha256(data).hexdigest()
        buf = None
        deadline = time.monotonic() + 30
        while buf is None and time.monotonic() < deadline:
            try:
                buf = await objstore.read_object(c, BUCKET, "big", expect_sha256=sha)
            except objstore.ObjectReadError:
                await asyncio.sleep(0.25)
        assert buf is not None and buf[:] == data
        await c.close()
    finally:
        server.terminate()
        server.wait()
