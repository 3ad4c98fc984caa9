"""The engine's reply probe (``orphans``) when the engine and the reader of a reply
subject sit on different nats-servers: a gateway pair (a super-cluster) and a hub with a
leaf node, both ways. The probe asks the server whether anyone subscribes; a false "no
responders" here would cancel live requests of every API on another server.

The reader subscribes its inbox and then sends its request with that inbox as the NATS
reply subject, over the same connection, as the API does. Over a leaf node the interest
travels on the same connection before the request. Over a gateway it does not: the
reader's server sends the interest (RS+) on the connection the engine's server dialled,
the request on the one it dialled itself, so the request can win — measured: a probe
of the bare inbox (sent in the payload, as this test first did) got a false "no
responders" in 5 of 110 runs with 3 busy loops on 2 cores. A reply subject with a
subscription younger than 5 s is routed back to its cluster whatever the interest
(nats-server's ``$GR.`` reply mapping), which is why the API's way saw none (0 of 110);
the engine still wants two no-responders in a row before calling a reader gone
(``test_one_no_responders_is_not_gone``, which holds the interest back to force it).
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
            await arrived.put(msg.reply)  # as the engine takes it

        await bus.nc.subscribe("probe.req", cb=on_request)
        await bus.nc.flush()
        await asyncio.sleep(0.3)  # the engine's own interest reaches the reader's server
        inbox = reader.new_inbox()
        sub = await reader.subscribe(inbox)
        await reader.publish("probe.req", b"", reply=inbox)  # same connection, after the SUB
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


class _HeldBack:
    """A TCP relay to ``port`` whose answers (far side to dialler) wait while ``hold`` is
    clear; what the dialler sends goes through at once."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.hold = asyncio.Event()
        self.hold.set()  # passing
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, near_r: asyncio.StreamReader, near_w: asyncio.StreamWriter) -> None:
        far_r, far_w = await asyncio.open_connection("127.0.0.1", self.port)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, gated: bool) -> None:
            while data := await r.read(65536):
                if gated:
                    await self.hold.wait()
                w.write(data)
                await w.drain()
            w.close()

        for r, w, gated in ((near_r, far_w, False), (far_r, near_w, True)):
            task = asyncio.ensure_future(pump(r, w, gated))
            self._tasks.add(task)


async def test_one_no_responders_is_not_gone(tmp_path: Path) -> None:
    """Gateways A and B; A dials B through a relay that can hold back what B sends on
    that connection — B's interest (RS+/RS-) for A — while B's messages to A go on B's
    own connection. A reader on B subscribes while its interest is held: the engine on
    A gets its request, and a probe says "no responders" for a reader that is there.
    The engine must not cancel on that one answer; once the interest is through, the
    reader is read; when it leaves, two rounds in a row find it gone."""
    ports, gw = [free_port(), free_port()], [free_port(), free_port()]
    relay = _HeldBack(gw[1])
    via = await relay.start()
    urls = {"A": f"127.0.0.1:{gw[0]}", "B": f"127.0.0.1:{via}"}  # B is reached via the relay
    nodes = []
    for i, name in enumerate("AB"):
        remotes = ", ".join(f'{{name: {n}, url: "nats://{u}"}}' for n, u in urls.items())
        conf = tmp_path / f"gw-{name}.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{ports[i]}\nserver_name: {name}\n"
            f"gateway {{ name: {name}, listen: 127.0.0.1:{gw[i]}, advertise: {urls[name]},"
            f" gateways: [{remotes}] }}\n"
        )
        nodes.append(Node(conf, {}, ports[i], log=tmp_path / f"gw-{name}.log"))
    try:
        for n in nodes:
            n.start()
        bus, reader = await _connected_pair(nodes[0].url, nodes[1].url)
        try:
            arrived: asyncio.Queue[str] = asyncio.Queue()

            async def on_request(msg: Any) -> None:
                await arrived.put(msg.data.decode())

            await bus.nc.subscribe("probe.req", cb=on_request)
            await bus.nc.flush()
            await asyncio.sleep(0.3)  # A's interest reaches B (not held: B dials A itself)
            relay.hold.clear()
            inbox = reader.new_inbox()
            sub = await reader.subscribe(inbox)
            # the bare inbox, not as the NATS reply: that one would be routed back to B
            # whatever the interest for 5 s ($GR. mapping), which hides the race
            await reader.publish("probe.req", inbox.encode())
            await reader.flush()
            req = SimpleNamespace(reply=await asyncio.wait_for(arrived.get(), 5), request_id="r1")
            rounds = orphans.Rounds(bus, lambda r, i: b"{}", lambda r: False, timeout=0.5)
            one = await orphans.unread(bus, [req], lambda r, i: b"{}", 0.5, lambda r: False)
            assert one == ["r1"], "the reader's interest was not held back: no race forced"
            assert await rounds.round([req]) == [], "a live reader called gone on one answer"
            relay.hold.set()
            for _ in range(50):  # its interest reaches A
                if await orphans.unread(bus, [req], lambda r, i: b"{}", 0.5, lambda r: False):
                    await asyncio.sleep(0.1)
                    continue
                break
            assert await rounds.round([req]) == [], "a live reader was called gone"
            await sub.unsubscribe()
            await reader.flush()
            for _ in range(50):  # its interest is withdrawn: the first round suspects it
                if rounds.suspected:
                    break
                assert await rounds.round([req]) == []
                await asyncio.sleep(0.1)
            assert await rounds.round([req]) == ["r1"], "a reader that left was not found"
        finally:
            await reader.close()
            await bus.close()
    finally:
        for n in nodes:
            n.stop()
        await relay.stop()
