"""Reads that wait on an inbox of their own (no request future), whose asking publish
nats-server refuses, fail at once naming the refused subject, instead of waiting out
their stall or fetch timeout: the object reader's batched direct gets (nats-py path and
:mod:`shared._fastwire`'s own connection), the version listing's direct gets, and the
auto-update's pull fetch (``$JS.API.CONSUMER.MSG.NEXT``). Real nats-server, with the
generated auth.conf where one role lost one grant (an auth.conf edited by hand, or one
older than the code).

Without the fix: the nats-py read ends "no data for 20s", the listing "no answer to a
direct get within 20s", the fetch returns [] ("nothing new") after 20 s, and the fast
path ended at once but as "protocol error: server error: '...'"; the assertions on the
error's text refuse each."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shared import objstore
from shared.bus import Bus
from shared.errors import FORBIDDEN, PublishDenied
from shared.messages import VersionPublished
from shared.subjects import CKPT_STREAM
from tests import natsconf

BUCKET = "rollbus_ckpt"
OBJ = f"OBJ_{BUCKET}"
WAIT_S = 20.0  # each read's own timeout: what it would wait without the fix
MIB = 1 << 20
# the grants taken away: the worker's batched direct get of the bucket (its metas are
# still read, through $JS.API.STREAM.MSG.GET), the trainer's of the version stream (its
# info still allowed), the engine's pull of the version stream (its durable's creation
# still allowed)
CHUNKS_API = f"$JS.API.DIRECT.GET.{OBJ}"
VERSIONS_API = f"$JS.API.DIRECT.GET.{CKPT_STREAM}"
PULL_API = f"$JS.API.CONSUMER.MSG.NEXT.{CKPT_STREAM}.>"
ROLES = ("engine", "trainer", "worker")


@pytest.fixture
async def roles(tmp_path: Path) -> AsyncIterator[dict[str, Bus]]:
    perms = {
        "worker": natsconf.without("worker", CHUNKS_API),
        "trainer": natsconf.without("trainer", VERSIONS_API),
        "engine": natsconf.without("engine", PULL_API),
    }
    async with natsconf.role_buses(tmp_path, ROLES, perms) as (_, buses):
        await objstore.ensure_bucket(buses["engine"].nc, BUCKET)
        await objstore.ensure_ckpt_stream(buses["engine"].nc, "m")
        yield buses


def _no_watch_left(bus: Bus) -> bool:
    return not bus.nc._asked  # type: ignore[attr-defined]


@pytest.mark.parametrize("fast", [False, True])
async def test_a_refused_chunk_direct_get_fails_the_read_at_once(
    roles: dict[str, Bus], fast: bool
) -> None:
    name = "m/v1/rank0-of-1.safetensors"
    data = os.urandom(objstore.FAST_READ_MIN + MIB + 5 if fast else 2 * MIB + 5)
    await objstore.put_object(roles["trainer"].nc, BUCKET, name, data)
    worker = roles["worker"]
    t0 = time.monotonic()
    with pytest.raises(objstore.ObjectReadError) as err:
        await objstore.read_object(worker.nc, BUCKET, name, stall_timeout=WAIT_S, fast=fast)
    assert time.monotonic() - t0 < WAIT_S
    msg = str(err.value)
    assert msg.startswith(f"{name}: permission denied: "), msg
    assert f"lack publish permission on {CHUNKS_API}" in msg, msg
    assert "pass" not in msg.lower() and "@" not in msg  # no credentials in it
    # refused, not lost: a 403 at the rank (services/worker/sources.py), not a 503
    assert isinstance(err.value, objstore.ObjectReadDenied) and err.value.code == FORBIDDEN
    assert _no_watch_left(worker)


async def test_a_refused_version_listing_fails_at_once(roles: dict[str, Bus]) -> None:
    await objstore.publish_version(roles["trainer"].nc, VersionPublished("m", "v1", 1))
    trainer = roles["trainer"]
    with pytest.raises(objstore.ObjectReadError) as err:
        await objstore._direct_all(trainer.nc, CKPT_STREAM, "rollbus.ckpt.m.published", WAIT_S)
    assert f"lack publish permission on {VERSIONS_API}" in str(err.value), err.value
    assert isinstance(err.value, objstore.ObjectReadDenied)
    with pytest.raises(objstore.ObjectReadError):  # as the trainer's SDK lists them
        await objstore.list_versions(trainer.nc, "m")
    assert _no_watch_left(trainer)


async def test_a_refused_pull_fails_the_fetch_at_once(roles: dict[str, Bus]) -> None:
    await objstore.publish_version(roles["trainer"].nc, VersionPublished("m", "v1", 1))
    engine = roles["engine"]
    feed = objstore.VersionFeed(engine.nc, "m", "rollbus_au_test")
    await feed.start()  # the durable's creation is allowed: only its pulls are refused
    with pytest.raises(PublishDenied) as denied:
        await feed.fetch(timeout=WAIT_S)
    assert denied.value.code == FORBIDDEN
    assert denied.value.subject == f"$JS.API.CONSUMER.MSG.NEXT.{CKPT_STREAM}.rollbus_au_test"
    assert _no_watch_left(engine)
    # the engine's other waits are untouched: a JetStream API call still answers
    assert (await engine.nc.jetstream().stream_info(CKPT_STREAM)).state.messages == 1
    await asyncio.sleep(0)


@pytest.mark.parametrize("fast", [False, True])
async def test_a_refused_chunk_publish_fails_the_put_at_once(tmp_path: Path, fast: bool) -> None:
    """The writer waits for its chunks' acks on an inbox of its own: a trainer that may
    write metas but not chunks failed its put only after ``ack_timeout`` (nats-py path:
    past the 16-chunk window, after it); now at once, naming the chunk subject. The fast
    path's own connection read the -ERR itself already (now worded the same)."""
    trainer_perms = natsconf.without("trainer", f"$O.{BUCKET}.>")
    trainer_perms["publish"].append(f"$O.{BUCKET}.M.>")
    perms = {"trainer": trainer_perms}
    async with natsconf.role_buses(tmp_path, ("engine", "trainer"), perms) as (_, buses):
        engine, trainer = buses["engine"], buses["trainer"]
        await objstore.ensure_bucket(engine.nc, BUCKET)
        data = os.urandom((objstore.PUT_WINDOW + 1) * MIB + 5 if not fast else 5 * MIB)
        t0 = time.monotonic()
        with pytest.raises(objstore.ObjectReadError) as err:
            await objstore.put_object(
                trainer.nc, BUCKET, "m/v1/x", data, ack_timeout=WAIT_S, fast=fast
            )
        assert time.monotonic() - t0 < WAIT_S
        msg = str(err.value)
        assert f"lack publish permission on $O.{BUCKET}.C." in msg, msg
        assert isinstance(err.value, objstore.ObjectReadDenied), repr(err.value)
        assert _no_watch_left(trainer)


OTHER = "rollbus_other"  # a second bucket, its direct gets allowed


def other_bucket_perms(*engine_without: str, worker_info: bool = False) -> dict[str, Any]:
    """The worker refused BUCKET's direct gets but allowed OTHER's (and, ``worker_info``, its
    stream info); the engine (``engine_without`` taken away) and the trainer may call any
    stream API, the trainer write OTHER."""
    worker = natsconf.without("worker", CHUNKS_API)
    if worker_info:
        worker["publish"].append(f"$JS.API.STREAM.INFO.OBJ_{OTHER}")
    worker["publish"] += [
        f"$JS.API.STREAM.MSG.GET.OBJ_{OTHER}",
        f"$JS.API.DIRECT.GET.OBJ_{OTHER}",
    ]
    engine = natsconf.without("engine", *engine_without)
    engine["publish"]["allow"].append("$JS.API.STREAM.>")
    trainer = natsconf.without("trainer")
    trainer["publish"] += [f"$O.{OTHER}.>", "$JS.API.STREAM.>"]
    return {"worker": worker, "engine": engine, "trainer": trainer}


async def test_refusals_leave_no_watcher_and_fail_only_their_own_reads(tmp_path: Path) -> None:
    """One connection reading two buckets at once, one refused (its direct gets), the
    other allowed: every refused read fails, every allowed one returns its bytes (a
    refusal names one subject exactly, never a sibling's), and after many refused, many
    successful and many cancelled reads and fetches no watcher is left registered."""
    other = OTHER
    perms = other_bucket_perms(PULL_API, worker_info=True)
    async with natsconf.role_buses(tmp_path, ROLES, perms) as (_, buses):
        nc = buses["worker"].nc
        await objstore.ensure_bucket(buses["engine"].nc, BUCKET)
        await objstore.ensure_bucket(buses["engine"].nc, other)
        await objstore.ensure_ckpt_stream(buses["engine"].nc, "m")
        small, big = os.urandom(3 * MIB + 1), os.urandom(objstore.FAST_READ_MIN + MIB)
        for b in (BUCKET, other):
            await objstore.put_object(buses["trainer"].nc, b, "small", small)
            await objstore.put_object(buses["trainer"].nc, b, "big", big)

        async def read(bucket: str, name: str) -> bytes:
            buf = await objstore.read_object(nc, bucket, name, stall_timeout=WAIT_S)
            return bytes(buf)

        for _ in range(3):
            got = await asyncio.gather(
                *(read(b, n) for b in (BUCKET, other) for n in ("small", "big") for _ in range(4)),
                return_exceptions=True,
            )
            refused, allowed = got[:8], got[8:]
            assert all(isinstance(e, objstore.ObjectReadDenied) for e in refused), refused
            assert allowed == [small] * 4 + [big] * 4
            assert not nc._asked  # type: ignore[attr-defined]
        # reads cancelled mid-way (allowed ones: the refused end before a cancel)
        for delay in (0.0, 0.001, 0.01, 0.05):
            tasks = [asyncio.ensure_future(read(other, n)) for n in ("small", "big")]
            await asyncio.sleep(delay)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert not nc._asked, delay  # type: ignore[attr-defined]
        # the engine's refused fetches, and one cancelled while it waits
        feed = objstore.VersionFeed(buses["engine"].nc, "m", "rollbus_au_leak")
        await feed.start()
        for _ in range(20):
            with pytest.raises(PublishDenied):
                await feed.fetch(timeout=WAIT_S)
        t = asyncio.ensure_future(feed.fetch(timeout=WAIT_S))
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        assert not buses["engine"].nc._asked  # type: ignore[attr-defined]
        assert len(buses["engine"].denied) == 1  # one subject, remembered once


async def test_refusals_after_a_server_restart(tmp_path: Path) -> None:
    """A server restart leaves no stale watcher (a read cut by it unregisters), and after
    the reconnect a refused read still fails at once, an allowed one still reads."""
    other = OTHER
    perms = other_bucket_perms()
    async with natsconf.role_buses(tmp_path, ROLES, perms) as (node, buses):
        nc = buses["worker"].nc
        data = os.urandom(64 * MIB)
        for b in (BUCKET, other):
            await objstore.ensure_bucket(buses["engine"].nc, b)
            await objstore.put_object(buses["trainer"].nc, b, "x", data)
        # an allowed read cut by the restart
        reading = asyncio.ensure_future(
            objstore.read_object(nc, other, "x", stall_timeout=WAIT_S, fast=False)
        )
        await asyncio.sleep(0.05)
        node.stop()
        with pytest.raises(objstore.ObjectReadError):
            await reading
        assert not nc._asked  # type: ignore[attr-defined]
        node.start()
        deadline = time.monotonic() + 20
        while not nc.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert nc.is_connected
        await asyncio.sleep(0.5)  # JetStream recovered its streams
        t0 = time.monotonic()
        with pytest.raises(objstore.ObjectReadDenied):
            await objstore.read_object(nc, BUCKET, "x", stall_timeout=WAIT_S, fast=False)
        assert time.monotonic() - t0 < WAIT_S / 2
        assert bytes(await objstore.read_object(nc, other, "x", fast=False)) == data
        assert not nc._asked  # type: ignore[attr-defined]
