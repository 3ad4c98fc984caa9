"""Routes of the ``infra/nats/cluster-*.conf`` cluster authenticate: a server without the
route credentials (``ROLLBUS_NATS_ROUTE_PASSWORD``) cannot join as a route; one with them
can (the control that the refusal is about the credentials)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import nats

from services import natsd
from tests import natsconf


def _routes(monitor_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/routez", timeout=2) as r:
        return int(json.load(r)["num_routes"])


def _rogue(tmp: Path, route_url: str, name: str) -> tuple[subprocess.Popen[bytes], int]:
    mon = natsconf.free_port()
    cmd = [
        natsd.find_binary(), "-a", "127.0.0.1", "-p", str(natsconf.free_port()),
        "-m", str(mon), "-n", name, "--cluster_name", "rollbus",
        "--cluster", f"nats://127.0.0.1:{natsconf.free_port()}", "--routes", route_url,
    ]
    log = open(tmp / f"{name}.log", "ab")  # noqa: SIM115 - kept open by the child
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(100):
        try:
            _routes(mon)
            break
        except OSError:
            time.sleep(0.05)
    return proc, mon


async def _cluster_size(url: str, password: str) -> int:
    """How many nodes the server at ``url`` knows (its INFO's client URLs)."""
    for _ in range(100):
        nc = await nats.connect(url, user="operator", password=password,
                                allow_reconnect=False, connect_timeout=2)
        n = len(set(nc._server_info.get("connect_urls") or []))
        await nc.close()
        if n >= 3:
            return n
        await asyncio.sleep(0.1)
    return n


def test_a_route_without_credentials_is_refused(tmp_path: Path) -> None:
    password = "route-" + natsconf.role_passwords()["api"]
    passwords = natsconf.role_passwords()
    nodes = natsconf.cluster(tmp_path, passwords, route_password=password)
    for n in nodes:
        n.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        route_port = int(re.findall(r"listen: 127\.0\.0\.1:(\d+)", nodes[0].conf.read_text())[1])

        # the three nodes found each other: their own routes carry the credentials
        assert asyncio.run(_cluster_size(nodes[0].url, passwords["operator"])) == 3
        for name, url in (
            ("nocreds", f"nats://127.0.0.1:{route_port}"),
            ("wrong", f"nats://rollbus_route:wrong@127.0.0.1:{route_port}"),
        ):
            proc, mon = _rogue(tmp_path, url, name)
            procs.append(proc)
            time.sleep(3)
            assert _routes(mon) == 0, (tmp_path / f"{name}.log").read_text()[-2000:]
            text = (tmp_path / "n1.log").read_text()
            assert "authentication error" in text.lower(), text[-2000:]
        # control: with the credentials the same server joins
        proc, mon = _rogue(tmp_path, f"nats://rollbus_route:{password}@127.0.0.1:{route_port}",
                           "withcreds")
        procs.append(proc)
        for _ in range(100):
            if _routes(mon) > 0:
                break
            time.sleep(0.1)
        assert _routes(mon) > 0
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        for n in nodes:
            n.stop()
