"""One real stack for every fault test, on a nats-server of its own (it gets killed).

The stack: ``rollbus serve`` (launcher, engine, 2 paddle ranks, API) with the
``object_store`` load strategy (versions ``v1``/``v2`` are snapshot dirs it falls back
to; ``p1`` is published to the object store), a short control timeout, and the
test-only windows ``ROLLBUS_TEST_STAGE_DELAY_S`` / ``ROLLBUS_TEST_COMMIT_DELAY_S``: every
rank waits that long before it runs a stage / commit, so a test can signal it inside
the window (it waits for the rank's "test delay before ..." log line) instead of relying
on timing luck. After each test the stack must be healthy again, at ``v0``, awake and
running — with no manual step beyond control calls.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.tiny_model import write_version
from tests.faults import common as c
from tests.faults.common import Faults, NatsProc


@pytest.fixture(scope="session")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    tmp = Path(tmp_path_factory.mktemp("faults"))
    nats = NatsProc(tmp / "nats", tmp / "nats.log")
    stack = c.fault_stack(tmp, nats, ROLLBUS_TEST_STAGE_DELAY_S=str(c.DELAY))
    c.wait_log(stack, "rollbus: ready:", 0)  # the launcher saw it ready: restarts apply
    write_version(stack.model_dir, "v1", seed=1)
    write_version(stack.model_dir, "v2", seed=2)
    try:
        yield Faults(stack, nats)
    finally:
        stack.stop()
        nats.stop()


@pytest.fixture(autouse=True)
def recovered_at_v0(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every fault test leaves the shared stack recovered: healthy, awake, running, v0."""
    yield
    if "faults" not in request.fixturenames:
        return
    f: Faults = request.getfixturevalue("faults")
    for pid in c.rank_pids(f.stack, quiet=True):
        c.signal_quietly(pid, signal.SIGCONT)
    if f.nats.proc is not None and f.nats.proc.poll() is not None:
        f.nats.start()
    st = c.wait_recovered(f.stack)
    if st["state"] == "sleeping":
        assert c.ctl(f.stack, "/v1/wakeup").status_code == 200
    if c.wait_recovered(f.stack)["weight_version"] != "v0":
        c.ctl(f.stack, "/v1/pause")
        r = c.ctl(f.stack, "/v1/update_weights", json={"version": "v0"})
        assert r.status_code == 200, r.text
    assert c.ctl(f.stack, "/v1/resume").status_code == 200
    st = c.wait_recovered(f.stack)
    assert st["state"] == "running" and st["weight_version"] == "v0", st
    c.assert_consistent(f.stack, "v0")  # and serving again
