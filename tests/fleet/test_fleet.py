"""A fleet of three instances (TP=1, each its own `rollbus serve`) on one external
nats-server with the roles of infra/nats/auth.conf, updated as one transaction.

One fleet for the module. Instance C's rank waits ``DELAY`` before every stage and every
commit (``ROLLBUS_TEST_STAGE_DELAY_S`` / ``_COMMIT_DELAY_S``), the window the fault tests
signal in. Every test ends with every instance running on one version.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from shared import creds
from shared import fleet as f
from tests import natsconf
from tests.e2e.stack import Stack, start_stack
from tests.faults.common import log_count, signal_quietly, wait_log

CT = 8.0  # ROLLBUS_CONTROL_TIMEOUT_S of every instance (start_stack's)
DELAY = 1.5
MARGIN = 15.0  # on 2 loaded cores
TOKEN = "fleet-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BOUND = 2 * CT + 5 + 3 * (CT + 5) + MARGIN  # a coordinator's worst case

pytestmark = pytest.mark.fleet


class Fleet:
    def __init__(self, node: natsconf.Node, creds_dir: Path, stacks: list[Stack]) -> None:
        self.node, self.creds_dir, self.stacks = node, creds_dir, stacks
        self.seq = 0

    @property
    def a(self) -> Stack:
        return self.stacks[0]

    @property
    def c(self) -> Stack:
        return self.stacks[2]

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in self.a.env.items() if k != "ROLLBUS_INSTANCE"}
        return {**env, **extra}

    def new_version(self, on: list[Stack] | None = None, corrupt: list[Stack] = ()) -> str:
        """A snapshot version (the model dir's files under ``versions/V``) on ``on``."""
        self.seq += 1
        v = f"fv{self.seq}"
        for s in on if on is not None else self.stacks:
            d = s.model_dir / "versions" / v
            d.mkdir(parents=True)
            for p in s.model_dir.glob("*.safetensors"):
                shutil.copy(p, d / p.name)
            shutil.copy(s.model_dir / "config.json", d / "config.json")
            if s in corrupt:
                for p in d.glob("*.safetensors"):
                    p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
        return v

    def versions(self) -> dict[str, tuple[str, str]]:
        out = {}
        for s in self.stacks:
            st = status(s)
            out[s.instance] = (st["weight_version"], st["state"])
        return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = Path(tmp_path_factory.mktemp("fleet"))
    passwords = natsconf.role_passwords()
    node = natsconf.single_with_auth(tmp, passwords)
    creds_dir = natsconf.write_creds_dir(tmp / "creds", passwords)
    node.start()
    env = {"ROLLBUS_NATS_CREDS_DIR": str(creds_dir), "ROLLBUS_ADMIN_TOKEN": TOKEN,
           "ROLLBUS_CONTROL_TIMEOUT_S": str(CT)}
    delays = {"ROLLBUS_TEST_STAGE_DELAY_S": str(DELAY), "ROLLBUS_TEST_COMMIT_DELAY_S": str(DELAY)}
    stacks: list[Stack] = []
    try:
        with ThreadPoolExecutor(3) as ex:
            futs = [
                ex.submit(start_stack, tmp / f"i{k}", node.url, tp=1,
                          env={**env, **(delays if k == 2 else {})})
                for k in range(3)
            ]
            for fu in futs:
                try:
                    stacks.append(fu.result())
                except Exception:
                    for other in futs:
                        if other.done() and other.exception() is None:
                            other.result().stop()
                    raise
        yield Fleet(node, creds_dir, stacks)
    finally:
        for s in stacks:
            s.stop()
        node.stop()


def fleet_update(stack: Stack, body: dict[str, Any], headers: dict[str, str] = AUTH
                 ) -> httpx.Response:
    with httpx.Client(base_url=stack.base_url, timeout=BOUND) as cl:
        return cl.post("/v1/fleet/update_weights", json=body, headers=headers)


def status(s: Stack) -> dict[str, Any]:
    with httpx.Client(base_url=s.base_url, timeout=30, headers=AUTH) as cl:
        r = cl.get("/v1/status")
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_recovered(s: Stack, timeout: float) -> dict[str, Any]:
    """/health 200 and every rank alive on the engine's version."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        assert s.proc.poll() is None, f"the stack stopped:\n{s.log_tail()}"
        try:
            h = httpx.get(s.base_url + "/health", timeout=10)
            if h.status_code == 200:
                st = status(s)
                if all(r.get("alive") for r in st["ranks"]) and {
                    r.get("version") for r in st["ranks"]
                } == {st["weight_version"]}:
                    return st
                last = st
            else:
                last = h.text
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.3)
    raise AssertionError(f"{s.instance} not recovered in {timeout:.0f}s: {last}\n{s.log_tail()}")


class InThread:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.out: Any = None
        self.err: BaseException | None = None
        self.t = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self.t.start()

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            self.out = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in result()
            self.err = e

    def result(self, bound: float = BOUND) -> Any:
        self.t.join(bound)
        assert not self.t.is_alive(), f"no answer within {bound}s"
        if self.err:
            raise self.err
        return self.out


def wait_all_running(fl: Fleet, version: str, bound: float) -> float:
    """Every instance running (health 200) on ``version``; returns how long it took."""
    t0 = time.monotonic()
    for s in fl.stacks:
        st = wait_recovered(s, timeout=max(1.0, bound - (time.monotonic() - t0)))
        while st["state"] != "running":
            assert time.monotonic() - t0 < bound, f"{s.instance} is {st['state']}"
            time.sleep(0.2)
            st = status(s)
        assert st["weight_version"] == version, (s.instance, st["weight_version"], version)
        assert st["fleet"] is None
    return time.monotonic() - t0


def generate(s: Stack) -> str:
    with httpx.Client(base_url=s.base_url, timeout=60) as cl:
        r = cl.post("/v1/completions", json={"model": "tiny", "prompt": "fleet", "max_tokens": 2})
    assert r.status_code == 200, r.text
    return str(r.json()["weight_version"])


async def _record(fl: Fleet, txn: str) -> f.Record | None:
    user, pw = creds.load(fl.creds_dir, "operator")
    nc = await nats.connect(creds.with_creds(fl.node.url, user, pw),
                            inbox_prefix=creds.inbox_prefix("operator"))
    try:
        got = await f.FleetBucket(nc).get(txn)
        return got[0] if got else None
    finally:
        await nc.close()


def record(fl: Fleet, txn: str) -> f.Record | None:
    return asyncio.run(_record(fl, txn))


# ------------------------------------------------------------------ tests


def test_discovery_and_fleet_status_json(fleet: Fleet) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "fleet", "status", "--json"],
        env=fleet.env(), capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["instance"] for row in rows] == sorted(s.instance for s in fleet.stacks)
    for row in rows:
        assert row["state"] == "running" and row["ranks"] == "1/1", row
        assert row["model"] == "tiny", row  # the served model name (ROLLBUS_MODEL_NAME)
        assert {"version", "waiting", "running"} <= set(row)
    table = subprocess.run(
        [sys.executable, "-m", "services.cli", "fleet", "status"],
        env=fleet.env(), capture_output=True, text=True, timeout=60,
    )
    assert table.returncode == 0
    assert table.stdout.split()[:4] == ["instance", "model", "state", "version"]
    assert all(s.instance in table.stdout for s in fleet.stacks)


def test_route_checks_token_and_body(fleet: Fleet) -> None:
    before = fleet.versions()
    assert fleet_update(fleet.a, {"version": "x"}, headers={}).status_code == 401
    r = fleet_update(fleet.a, {"version": "x", "pausemode": "keep"})
    assert r.status_code == 400 and r.json()["result"]["param"] == "pausemode", r.text
    assert fleet_update(fleet.a, {"version": "x", "pause_mode": "now"}).status_code == 400
    # a name no rank could load: 400 naming it, before any instance is paused or asked
    staged = log_count(fleet.c, "test delay before stage")  # C's rank logs every stage
    r = fleet_update(fleet.a, {"version": "../../etc", "pause_mode": "abort"})
    assert r.status_code == 400 and r.json()["result"]["param"] == "version", r.text
    assert log_count(fleet.c, "test delay before stage") == staged
    for bad in ("", "a/b"):
        c = subprocess.run(
            [sys.executable, "-m", "services.cli", "fleet", "update", "--version", bad],
            env=fleet.env(), capture_output=True, text=True, timeout=60,
        )
        assert c.returncode == 2 and c.stdout == "", c.stdout + c.stderr
        assert c.stderr.startswith("rollbus fleet update: bad argument 'version'"), c.stderr
        assert len(c.stderr.strip().splitlines()) == 1
    assert fleet.versions() == before


def test_all_instances_switch(fleet: Fleet) -> None:
    v = fleet.new_version()
    prev = fleet.versions()
    r = fleet_update(fleet.stacks[1], {"version": v, "pause_mode": "keep"})
    assert r.status_code == 200, r.text
    res = r.json()["result"]
    assert res["decision"] == "done"
    assert {o["instance"]: o["outcome"] for o in res["instances"]} == {
        s.instance: "switched" for s in fleet.stacks
    }
    for o in res["instances"]:
        assert o["previous_version"] == prev[o["instance"]][0] and o["version"] == v
    assert record(fleet, res["txn"]).decision == "done"  # type: ignore[union-attr]
    wait_all_running(fleet, v, MARGIN)
    for s in fleet.stacks:
        assert {rk["version"] for rk in status(s)["ranks"]} == {v}
        assert generate(s) == v


def test_cli_update_exit_codes(fleet: Fleet) -> None:
    """`rollbus fleet update` as the operator: exit 0 when all switched, 1 when not."""
    v = fleet.new_version()
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "fleet", "update", "--version", v,
         "--pause-mode", "abort", "--json"],
        env=fleet.env(), capture_output=True, text=True, timeout=BOUND,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["error_code"] == 200 and {o["outcome"] for o in res["instances"]} == {"switched"}
    wait_all_running(fleet, v, MARGIN)
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "fleet", "update", "--version", "nowhere"],
        env=fleet.env(), capture_output=True, text=True, timeout=BOUND,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NOT switched (404)" in r.stdout and "rollbus fleet update:" in r.stderr
    wait_all_running(fleet, v, MARGIN)


def cli(fleet: Fleet, *args: str, timeout: float = BOUND) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "fleet", *args],
                          env=fleet.env(), capture_output=True, text=True, timeout=timeout)


async def _member(fl: Fleet, m: f.Member | None, name: str = "") -> None:
    """Write (``m``) or delete (``name``) a member record, as the engine role."""
    user, pw = creds.load(fl.creds_dir, "engine")
    nc = await nats.connect(creds.with_creds(fl.node.url, user, pw),
                            inbox_prefix=creds.inbox_prefix("engine"))
    try:
        if m is not None:
            await f.FleetBucket(nc).put_member(m)
        else:
            await f.FleetBucket(nc).delete_member(name)
    finally:
        await nc.close()


def test_a_stopped_instance_is_unreachable_and_nothing_commits(fleet: Fleet) -> None:
    """An engine that misses the discovery ping (SIGSTOP) is still a member (its record):
    `fleet status` shows it unreachable (exit 1), an update is 503 naming it and switches
    none; after SIGCONT it is back on its version."""
    b = fleet.stacks[1]
    old = fleet.versions()[fleet.a.instance][0]
    v = fleet.new_version()
    pid = int(status(b)["engine_pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        st = cli(fleet, "status", "--json", timeout=60)
        assert st.returncode == 1, st.stdout + st.stderr
        rows = {r["instance"]: r for r in json.loads(st.stdout)}
        assert set(rows) == {s.instance for s in fleet.stacks}
        assert rows[b.instance]["state"] == "unreachable" and rows[b.instance]["model"] == "tiny"
        r = fleet_update(fleet.a, {"version": v})
        assert r.status_code == 503, r.text
        assert b.instance in r.json()["error_message"]
        res = r.json()["result"]
        assert res["decision"] == "abort"
        out = {o["instance"]: o for o in res["instances"]}
        assert out[b.instance]["outcome"] == "unreachable", out
        assert out[b.instance]["error_code"] == 503
        for s in fleet.stacks:
            if s is not b:
                assert out[s.instance]["outcome"] == "stayed" and out[s.instance]["version"] == old
    finally:
        os.kill(pid, signal.SIGCONT)
    _all_on(fleet, old, BOUND)


def test_update_covers_the_model_and_a_stale_member_drops_out(fleet: Fleet) -> None:
    """A (silent) member serving another model: `fleet update` without --model refuses
    (exit 2), with --model tiny it leaves it out, the route uses its own model; a record
    older than 3 x CONTROL_TIMEOUT_S counts for nothing."""
    now = time.time()
    ghost = f.Member("ghost", "other-model", 1, now, now)
    stale = f.Member("stale", "tiny", 2, now - 10 * CT, now - 3 * CT - 5)
    asyncio.run(_member(fleet, ghost))
    asyncio.run(_member(fleet, stale))
    try:
        st = cli(fleet, "status", "--json", timeout=60)
        rows = {r["instance"]: r for r in json.loads(st.stdout)}
        assert rows["ghost"]["model"] == "other-model" and rows["ghost"]["state"] == "unreachable"
        assert "stale" not in rows and st.returncode == 1
        v = fleet.new_version()
        r = cli(fleet, "update", "--version", v)
        assert r.returncode == 2 and "--model" in r.stderr, r.stdout + r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        r = cli(fleet, "update", "--version", v, "--model", "tiny", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert sorted(o["instance"] for o in res["instances"]) == sorted(
            s.instance for s in fleet.stacks)
        _all_on(fleet, v)
        v2 = fleet.new_version()
        resp = fleet_update(fleet.c, {"version": v2})
        assert resp.status_code == 200, resp.text
        assert "ghost" not in {o["instance"] for o in resp.json()["result"]["instances"]}
        _all_on(fleet, v2)
        # names pinned: exactly those (a name without a member record is unreachable:
        # nothing commits)
        v3 = fleet.new_version()
        r = cli(fleet, "update", "--version", v3, "--instances", f"{fleet.a.instance},nobody",
                "--json")
        assert r.returncode == 1, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert {o["instance"]: o["outcome"] for o in res["instances"]} == {
            fleet.a.instance: "stayed", "nobody": "unreachable"}
        _all_on(fleet, v2)
    finally:
        asyncio.run(_member(fleet, None, "ghost"))
        asyncio.run(_member(fleet, None, "stale"))


def _all_on(fleet: Fleet, version: str, bound: float = CT + MARGIN) -> None:
    wait_all_running(fleet, version, bound)
    for s in fleet.stacks:
        assert generate(s) == version


def test_a_version_missing_on_one_instance_switches_none(fleet: Fleet) -> None:
    old = fleet.versions()[fleet.a.instance][0]
    v = fleet.new_version(on=fleet.stacks[:2])  # not on C
    r = fleet_update(fleet.a, {"version": v})
    assert r.status_code == 404, r.text
    res = r.json()["result"]
    assert res["decision"] == "abort"
    out = {o["instance"]: o for o in res["instances"]}
    c = out[fleet.c.instance]
    assert c["phase"] == "stage" and c["outcome"] == "failed", c
    assert fleet.c.instance in r.json()["error_message"]
    _all_on(fleet, old)


def test_a_corrupt_shard_on_one_instance_switches_none(fleet: Fleet) -> None:
    old = fleet.versions()[fleet.a.instance][0]
    v = fleet.new_version(corrupt=[fleet.stacks[1]])
    r = fleet_update(fleet.c, {"version": v, "pause_mode": "abort"})
    assert r.status_code == 422, r.text
    assert r.json()["result"]["decision"] == "abort"
    _all_on(fleet, old)


def test_coordinator_killed_between_stage_and_commit(fleet: Fleet) -> None:
    old = fleet.versions()[fleet.a.instance][0]
    v = fleet.new_version()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "fleet", "update", "--version", v],
        env=fleet.env(ROLLBUS_TEST_FLEET_COMMIT_DELAY_S="120"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "test delay before commit" in line, line + proc.stdout.read()
        txn = line.split()[1].rstrip(":")
        for s in fleet.stacks:  # every instance holds the version staged
            st = status(s)
            assert st["state"] == "updating" and st["fleet"]["txn"] == txn, st
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        took = wait_all_running(fleet, old, CT + MARGIN)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < CT + MARGIN
    rec = record(fleet, txn)
    assert rec is not None and rec.decision == "abort" and rec.reason.startswith("instance")
    for s in fleet.stacks:
        assert generate(s) == old


def test_a_late_coordinator_cannot_commit(fleet: Fleet) -> None:
    """A coordinator slower than CONTROL_TIMEOUT_S between stage and commit: the instances
    abort first (CAS), so its commit decision fails and it reports the abort."""
    old = fleet.versions()[fleet.a.instance][0]
    v = fleet.new_version()
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "fleet", "update", "--version", v, "--json"],
        env=fleet.env(ROLLBUS_TEST_FLEET_COMMIT_DELAY_S=str(CT + 4)),
        capture_output=True, text=True, timeout=BOUND,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout[r.stdout.index("{"):])
    assert res["decision"] == "abort" and res["error_code"] == 503, res
    assert "did not hear from the coordinator" in res["error_message"]
    assert record(fleet, res["txn"]).decision == "abort"  # type: ignore[union-attr]
    _all_on(fleet, old)


def _kill_during(fleet: Fleet, phase: str, what: str) -> tuple[httpx.Response, str, str]:
    """Fleet update from A; SIGKILL C's rank or engine inside C's rank's ``phase`` delay."""
    old = fleet.versions()[fleet.a.instance][0]
    v = fleet.new_version()
    st = status(fleet.c)
    pid = int(st["engine_pid"]) if what == "engine" else int(st["ranks"][0]["pid"])
    needle = f"test delay before {phase}"
    before = log_count(fleet.c, needle)
    call = InThread(fleet_update, fleet.a, {"version": v})
    wait_log(fleet.c, needle, before, timeout=60)
    signal_quietly(pid, signal.SIGKILL)
    r = call.result()
    return r, old, v


@pytest.mark.parametrize("what", ["rank", "engine"])
def test_instance_killed_during_stage(fleet: Fleet, what: str) -> None:
    r, old, _ = _kill_during(fleet, "stage", what)
    assert r.status_code == 503, r.text
    assert r.json()["result"]["decision"] == "abort"
    _all_on(fleet, old, bound=150)


@pytest.mark.parametrize("what", ["rank", "engine"])
def test_instance_killed_during_commit(fleet: Fleet, what: str) -> None:
    r, old, _ = _kill_during(fleet, "commit", what)
    # C's commit fails (its rank is gone) or never answers (its engine is gone): the
    # coordinator writes abort and every instance swaps back
    assert r.status_code == 503, r.text
    res = r.json()["result"]
    assert res["decision"] == "abort"
    out = {o["instance"]: o["outcome"] for o in res["instances"]}
    assert out[fleet.a.instance] == out[fleet.stacks[1].instance] == "rolled_back", r.text
    _all_on(fleet, old, bound=150)
