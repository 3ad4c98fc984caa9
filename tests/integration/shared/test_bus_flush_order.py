"""``subscribe`` then ``flush`` is the barrier the tests and services rely on ("the server
has the subscription"). nats-py (2.16) writes a flush's PING straight to the socket,
ahead of a SUB still queued for its flusher task, so the PONG could come back before
the server had the SUB: a request sent next got "no responders" now and then (seen in
``tests/integration/test_bus_publish_denied.py``). Real nats-server; the order of the
bytes written is asserted, not a timing."""

from __future__ import annotations

from pathlib import Path

from shared.bus import Bus
from tests import natsconf


async def test_a_flush_is_written_after_the_commands_before_it(tmp_path: Path) -> None:
    passwords = natsconf.role_passwords()
    node = natsconf.single_with_auth(tmp_path, passwords)
    node.start()
    try:
        bus = await Bus.connect(
            f"nats://engine:{passwords['engine']}@127.0.0.1:{node.port}", "test-engine"
        )
        try:
            transport = bus.nc._transport  # type: ignore[attr-defined]
            written: list[bytes] = []
            write, writelines = transport.write, transport.writelines

            def on_write(data: bytes) -> None:
                written.append(bytes(data))
                write(data)

            def on_writelines(lines: list[bytes]) -> None:
                written.extend(bytes(x) for x in lines)
                writelines(lines)

            transport.write, transport.writelines = on_write, on_writelines
            await bus.nc.subscribe("rollbus.default.ctl.x")
            await bus.nc.flush()
            ops = [w.split(b" ", 1)[0].strip() for w in written]
            assert ops.index(b"SUB") < ops.index(b"PING"), written
        finally:
            await bus.close()
    finally:
        node.stop()
