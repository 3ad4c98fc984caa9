"""rollbus on the 3-node cluster of ``infra/nats/cluster-*.conf`` (``sync_interval: always``,
roles from ``auth.conf``), with nodes killed by real signals.

- every stream and bucket rollbus creates is R3 (auto: the cluster has 3 nodes);
- a version event acknowledged by the stream leader survives ``kill -9`` of that leader;
- a node killed during an ``update_weights`` pull, and during a storm of control calls:
  every call completes or fails cleanly (a reply, or the client's timeout), never hangs,
  and the next call works; a version published before the kill still loads.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from services import natsd
from services.tiny_model import create_model_dir
from shared import creds, objstore
from shared.messages import VersionPublished
from tests import natsconf
from tests.e2e.stack import free_port, wait_healthy

CALL_S = 45.0  # bound of one control call as the operator's client waits for it
PULL_MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 8}


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.passwords = natsconf.role_passwords()
        self.nodes = natsconf.cluster(tmp, self.passwords)
        self.creds_dir = natsconf.write_creds_dir(tmp / "creds", self.passwords)

    @property
    def urls(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def role_urls(self, role: str, nodes: list[natsconf.Node] | None = None) -> list[str]:
        return [
            creds.with_creds(n.url, role, self.passwords[role]) for n in (nodes or self.nodes)
        ]

    def node_named(self, name: str) -> natsconf.Node:
        return self.nodes[int(name.rsplit("n", 1)[1]) - 1]

    async def connect(self, role: str, nodes: list[natsconf.Node] | None = None) -> Client:
        return await nats.connect(
            self.role_urls(role, nodes),
            inbox_prefix=creds.inbox_prefix(role),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            connect_timeout=2,
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(Path(tmp_path_factory.mktemp("cluster")))
    for n in c.nodes:
        n.start()
    try:
        asyncio.run(_wait_jetstream(c))
        yield c
    finally:
        for n in c.nodes:
            n.stop()


async def _wait_jetstream(c: Cluster, timeout: float = 60.0) -> None:
    nc = await c.connect("operator")
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await nc.jetstream().account_info()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = Path(tmp_path_factory.mktemp("stack"))
    api = free_port()
    # bigger than the default tiny model (~34 MB of fp32 weights), so that a pull lasts
    # long enough for a node to be killed in the middle of it
    model = create_model_dir(tmp / "models" / "tiny", config=PULL_MODEL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_")}
    env.update(
        ROLLBUS_NATS_URL=cluster.urls,  # no credentials: each child gets its role's
        ROLLBUS_NATS_CREDS_DIR=str(cluster.creds_dir),
        ROLLBUS_API_PORT=str(api),
        ROLLBUS_DATA_DIR=str(tmp / "data"),
        ROLLBUS_TP="1",
        ROLLBUS_MODEL=str(model),
        ROLLBUS_LOAD_STRATEGY="object_store",
        ROLLBUS_CONTROL_TIMEOUT_S="20",
        ROLLBUS_LOG_LEVEL="warning",
    )
    log = tmp / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"], cwd=tmp, env=env,
        stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
    )
    try:
        wait_healthy(f"http://127.0.0.1:{api}", proc, log, timeout=180)
        for v in ("v1", "v2"):  # published before any node is killed
            r = subprocess.run(
                [sys.executable, "-m", "services.cli", "publish", str(model), "--model", "tiny",
                 "--version", v, "--tp", "1"],
                env=env, capture_output=True, text=True, timeout=120,
            )
            assert r.returncode == 0, r.stderr
        yield {"proc": proc, "log": log, "env": env}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
async def restore(cluster: Cluster) -> AsyncIterator[None]:
    """Whatever a test killed is started again, and the cluster is whole before the next."""
    yield
    for n in cluster.nodes:
        if n.proc is None or n.proc.poll() is not None:
            n.start()
    await _wait_jetstream(cluster)
    await _wait_current(cluster)


async def _wait_current(c: Cluster, timeout: float = 60.0) -> None:
    """Every rollbus stream has a leader and all replicas current."""
    nc = await c.connect("trainer")
    try:
        deadline = time.monotonic() + timeout
        for stream in ("ROLLBUS_CKPT", "OBJ_rollbus_ckpt"):
            while True:
                try:
                    si = await nc.jetstream().stream_info(stream)
                    cl = si.cluster
                    if cl and cl.leader and all(p.current for p in cl.replicas or []):
                        break
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"{stream} did not recover")
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def _wait_leader(c: Cluster, stream: str, timeout: float = 60.0) -> None:
    """``stream`` has a leader again (on the nodes still alive)."""
    alive = [n for n in c.nodes if n.proc is not None and n.proc.poll() is None]
    deadline = time.monotonic() + timeout
    while True:
        nc = None
        try:
            nc = await c.connect("trainer", alive)
            si = await nc.jetstream().stream_info(stream)
            if si.cluster and si.cluster.leader:
                return
        except Exception:
            pass
        finally:
            if nc is not None:
                await nc.close()
        if time.monotonic() > deadline:
            raise AssertionError(f"{stream} has no leader")
        await asyncio.sleep(0.5)


async def _leader(c: Cluster, role: str, stream: str) -> natsconf.Node:
    nc = await c.connect(role)
    try:
        si = await nc.jetstream().stream_info(stream)
        assert si.cluster and si.cluster.leader
        return c.node_named(si.cluster.leader)
    finally:
        await nc.close()


async def _ctl(nc: Client, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    rep = await nc.request(
        f"rollbus.default.ctl.{method}", json.dumps(body or {}).encode(), timeout=CALL_S
    )
    return dict(json.loads(rep.data))


async def _until_answers(nc: Client, timeout: float = 60.0) -> None:
    """The engine answers again (after a node's death its clients reconnect)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            rep = await nc.request("rollbus.default.ctl.status", b"{}", timeout=2)
            if json.loads(rep.data).get("error_code") == 200:
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("the engine did not answer again")
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------------- the tests


async def test_streams_and_buckets_are_r3(cluster: Cluster, stack: dict[str, Any]) -> None:
    trainer, engine = await cluster.connect("trainer"), await cluster.connect("engine")
    try:
        infos = [
            await trainer.jetstream().stream_info("ROLLBUS_CKPT"),
            await trainer.jetstream().stream_info("OBJ_rollbus_ckpt"),
            await engine.jetstream().stream_info("ROLLBUS_EVENTS"),
        ]
        assert objstore.replicas_for(engine) == 3
        # the engine's state bucket, created by the running engine (shared/statekv.py)
        infos.append(await engine.jetstream().stream_info(f"KV_{natsd.KV_BUCKET}"))
        for si in infos:
            assert si.config.num_replicas == 3, si.config.name
            assert si.cluster and len(si.cluster.replicas or []) == 2, si.config.name
    finally:
        await trainer.close()
        await engine.close()


async def test_version_event_survives_kill9_of_its_leader(
    cluster: Cluster, stack: dict[str, Any], restore: None
) -> None:
    trainer = await cluster.connect("trainer")
    try:
        ev = VersionPublished("tiny", "acked-then-kill", 1, 0, publisher="test")
        seq = await objstore.publish_version(trainer, ev)
    finally:
        await trainer.close()
    leader = await _leader(cluster, "trainer", "ROLLBUS_CKPT")
    leader.kill(signal.SIGKILL)
    others = [n for n in cluster.nodes if n is not leader]
    nc = await cluster.connect("trainer", others)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                got = {s: e.version for s, e in await objstore.list_versions(nc, "tiny")}
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)  # a new leader is being elected
        assert got.get(seq) == "acked-then-kill"
    finally:
        await nc.close()


async def test_node_killed_during_update_weights_pull(
    cluster: Cluster, stack: dict[str, Any], restore: None
) -> None:
    # the node serving the bucket dies; the operator is on the other two, so the call's
    # reply must come (a 200, or an error naming what failed) — never silence
    victim = await _leader(cluster, "trainer", "OBJ_rollbus_ckpt")
    op = await cluster.connect("operator", [n for n in cluster.nodes if n is not victim])
    try:
        assert (await _ctl(op, "pause"))["error_code"] == 200
        call = asyncio.ensure_future(_ctl(op, "update_weights", {"version": "v2"}))
        await asyncio.sleep(0.1)  # the rank is pulling now
        victim.kill(signal.SIGKILL)
        rep = await asyncio.wait_for(call, CALL_S + 5)
        print("update_weights during the kill:", rep["error_code"], rep["error_message"])
        assert rep["error_code"] == 200 or (rep["error_code"] >= 500 and rep["error_message"])
        await _until_answers(op)
        # the bucket's stream elects a new leader among the two survivors (under load this
        # can outlast the reader's own retry window); then the next call works, and a
        # version published before the kill loads
        await _wait_leader(cluster, "OBJ_rollbus_ckpt")
        rep = await _ctl(op, "update_weights", {"version": "v1"})
        assert rep["error_code"] == 200, rep
        st = await _ctl(op, "status")
        assert st["result"]["weight_version"] == "v1", st
        assert (await _ctl(op, "resume"))["error_code"] == 200
    finally:
        await op.close()


async def test_node_killed_during_control_storm(
    cluster: Cluster, stack: dict[str, Any], restore: None
) -> None:
    op = await cluster.connect("operator")
    try:
        await _until_answers(op)

        async def one(i: int) -> str:
            method = ("status", "is_paused", "health", "pause", "resume")[i % 5]
            try:
                rep = await _ctl(op, method)
                return "ok" if rep["error_code"] == 200 else "error"
            except (TimeoutError, nats.errors.Error):
                return "failed"

        calls = [asyncio.ensure_future(one(i)) for i in range(60)]
        await asyncio.sleep(0.1)
        victim = await _leader(cluster, "engine", "ROLLBUS_EVENTS")
        victim.kill(signal.SIGKILL)
        done = await asyncio.wait_for(asyncio.gather(*calls), CALL_S + 15)
        assert set(done) <= {"ok", "error", "failed"} and len(done) == 60
        await _until_answers(op)
        assert (await _ctl(op, "pause"))["error_code"] == 200
        assert (await _ctl(op, "resume"))["error_code"] == 200
    finally:
        await op.close()
