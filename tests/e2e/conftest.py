from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, start_stack


@pytest.fixture(scope="module")
def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One tp=2 stack per module, on the session's nats-server."""
    s = start_stack(Path(tmp_path_factory.mktemp("stack")), nats_url, tp=2)
    try:
        yield s
    finally:
        s.stop()
