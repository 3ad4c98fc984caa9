"""The role permissions (granted for ``rollbus.*.``) serve a second instance as they serve
the first: two instances' engines, ranks and APIs on one server with the same
credentials, each on its own subjects — control, streamed gen, step/scatter to the
ranks, events into ``ROLLBUS_EVENTS`` (both instances' subjects), each engine's state
key — against the embedded server's generated config and ``auth.conf``."""

from __future__ import annotations

import nats

from shared import objstore, statekv
from shared.bus import Bus
from shared.subjects import Subjects
from tests.integration.test_nats_permissions import Server, connect, routed
from tests.integration.test_nats_permissions import server as server  # noqa: F401 - fixture


async def _instance(server: Server, name: str) -> tuple[Bus, Bus, Bus]:
    """An engine, one rank and an API of instance ``name``, the engine serving its own
    subjects and the rank its own."""
    sub = Subjects(name)
    engine = await Bus.connect(server.url("engine"), f"engine-{name}")
    worker = await Bus.connect(server.url("worker"), f"worker-{name}")
    api = await Bus.connect(server.url("api"), f"api-{name}")
    svc = await engine.add_service("rollbus-engine", "0.1.0")

    async def whoami(data: bytes, headers: dict[str, str]) -> bytes:
        return name.encode()

    await engine.serve(svc, "health", sub.ctl("health"), whoami, queue="engine")

    async def on_gen(msg: nats.aio.msg.Msg) -> None:
        for i in range(2):
            await engine.publish(msg.reply, f"{name}{i}".encode())

    await engine.subscribe(sub.gen, on_gen, queue="engine")
    wsvc = await worker.add_service("rollbus-worker", "0.1.0")
    await worker.serve(
        wsvc, "ping", sub.worker_ctl("ping"), whoami, queue="rank0",
        reply_headers={"Rollbus-Rank": "0"},
    )
    await objstore.ensure_events_stream(engine.nc, sub.event(">"))
    for b in (engine, worker):
        await b.flush()
    return engine, worker, api


async def test_two_instances_share_the_server_with_one_set_of_credentials(
    server: Server,  # noqa: F811
) -> None:
    names = ("first", "second.b")  # the second one needs escaping too
    buses = [await _instance(server, n) for n in names]
    try:
        for name, (engine, _worker, api) in zip(names, buses, strict=True):
            sub = Subjects(name)
            await routed(api, sub.ctl("health"))
            rep = await api.request(sub.ctl("health"), b"{}", timeout=5)
            assert rep.data == name.encode()  # its own engine, not the other's
            got = []
            async for r in api.stream(sub.gen, b"{}", idle_timeout=5):
                got.append(r.data)
                if len(got) == 2:
                    break
            assert got == [f"{name}0".encode(), f"{name}1".encode()]
            reps = await engine.scatter(sub.worker_ctl("ping"), b"{}", expected=1, timeout=5)
            assert reps[0].data == name.encode()
            ack = await engine.nc.jetstream().publish(sub.event("state"), b"{}")
            assert ack.stream == objstore.EVENTS_STREAM
            kv = statekv.StateBucket(engine.nc, name)
            await kv.put(name.encode())
            assert await kv.get() == name.encode()
        # the operator sees both instances' events and reaches both engines
        op = await connect(server.url("operator"), inbox="_INBOX")
        try:
            for name in names:
                rep = await op.nc.request(Subjects(name).ctl("health"), b"{}", timeout=5)
                assert rep.data == name.encode()
            assert op.errors == []
        finally:
            await op.nc.close()
    finally:
        for trio in buses:
            for b in trio:
                await b.close()
