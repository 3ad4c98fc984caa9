"""The engine's reply probe (``orphans.unread``) when the engine and the reader of a reply
subject sit on different nats-servers: a gateway pair (a super-cluster) and a hub with a
leaf node, both ways. The probe asks the server whether anyone subscribes; a false "no
responders" here would cancel live requests of every API on another server.

The reader subscribes its inbox and then sends its request over the same connection, as
the API does: NATS forwards interest before the messages that follow it on a connection,
so the engine's first probe, sent the moment the request arrives, already sees the
reader. Measured with raw nats-py while writing this: a probe from a *different*
connection within milliseconds of the subscribe does get a false "no responders" over a
leaf node (interest not yet forwarded), which is why that ordering is what is tested.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats
import pytest

from services.engine import orphans
from shared.bus import Bus
from tests.natsconf import Node, free_port


def _gateways(tmp: Path) -> list[Node]:
    ports, gw = [free_port(), free_port()], [free_port(), free_port()]
    nodes = []
    for i, name in enumerate("AB"):
        remotes = ", ".join(
            f'{{name: {n}, url: "nats://127.0.0.1:{gw[j]}"}}' for j, n in enumerate("AB")
        )
        conf = tmp / f"gw-{name}.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{ports[i]}\nserver_name: {name}\n"
            f"gateway {{ name: {name}, listen: 127.0.0.1:{gw[i]}, gateways: [{remotes}] }}\n"
        )
        nodes.append(Node(conf, {}, ports[i], log=tmp / f"gw-{name}.log"))
    return nodes


def _hub_and_leaf(tmp: Path) -> list[Node]:
    hub, leaf, leaf_listen = free_port(), free_port(), free_port()
    (tmp / "hub.conf").write_text(
        f"listen: 127.0.0.1:{hub}\nserver_name: hub\n"
        f"leafnodes {{ listen: 127.0.0.1:{leaf_listen} }}\n"
    )
    (tmp / "leaf.conf").write_text(
        f"listen: 127.0.0.1:{leaf}\nserver_name: leaf\n"
        f'leafnodes {{ remotes: [{{url: "nats://127.0.0.1:{leaf_listen}"}}] }}\n'
    )
    return [
        Node(tmp / "hub.conf", {}, hub, log=tmp / "hub.log"),
        Node(tmp / "leaf.conf", {}, leaf, log=tmp / "leaf.log"),
    ]


@pytest.fixture(params=["gateway", "leaf"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[Node]]:
    nodes = (_gateways if request.param == "gateway" else _hub_and_leaf)(tmp_path)
    try:
        for n in nodes:
            n.start()
        yield nodes
    finally:
        for n in nodes:
            n.stop()


async def _connected_pair(engine_url: str, reader_url: str) -> tuple[Bus, Any]:
    # both servers answer before their link is up: wait until a message crosses it
    for _ in range(200):
        bus = await Bus.connect(engine_url, "engine")
        reader = await nats.connect(reader_url)
        sub = await bus.nc.subscribe("link.check")
        await bus.nc.flush()
        await asyncio.sleep(0.05)
        await reader.publish("link.check", b"")
        await reader.flush()
        try:
            await sub.next_msg(timeout=0.2)
            await sub.unsubscribe()
            return bus, reader
        except nats.errors.TimeoutError:
            await reader.close()
            await bus.close()
    raise AssertionError("the two nats-servers never linked")


async def _probe_across(engine_url: str, reader_url: str) -> None:
    bus, reader = await _connected_pair(engine_url, reader_url)
    try:
        arrived: asyncio.Queue[str] = asyncio.Queue()

        async def on_request(msg: Any) -> None:
            await arrived.put(msg.data.decode())

        await bus.nc.subscribe("probe.req", cb=on_request)
        await bus.nc.flush()
        await asyncio.sleep(0.3)  # the engine's own interest reaches the reader's server
        inbox = reader.new_inbox()
        sub = await reader.subscribe(inbox)
        await reader.publish("probe.req", inbox.encode())  # same connection, after the SUB
        await reader.flush()
        reply = await asyncio.wait_for(arrived.get(), 5)
        req = SimpleNamespace(reply=reply, request_id="r1")

        def probe() -> Any:
            return orphans.unread(
                bus, [req], lambda r, i: b"{}", timeout=0.5, batched=lambda r: False
            )

        for _ in range(3):  # at once, and again while the reader stays
            assert await probe() == [], "a live reader on the other server was called gone"
            await asyncio.sleep(0.2)
        await sub.unsubscribe()
        await reader.flush()
        for _ in range(50):  # its interest is withdrawn across the link
            if await probe() == ["r1"]:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("a reader that left the other server was never found gone")
    finally:
        await reader.close()
        await bus.close()


async def test_probe_across_servers_both_ways(pair: list[Node]) -> None:
    a, b = pair
    await _probe_across(a.url, b.url)
    await _probe_across(b.url, a.url)
