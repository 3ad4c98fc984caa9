from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import Stack, start_stack


class SharedStacks:
    """Stacks started once per session, one per config, for the modules that ask for the
    same config (a stack start is 10-20 s of CI). A module that pauses, sleeps or updates
    one must leave it as it found it (running, awake, on its version); :meth:`lend`
    checks that at the module's end."""

    def __init__(self, nats_url: str, tmp: pytest.TempPathFactory) -> None:
        self.nats_url, self.tmp = nats_url, tmp
        self.stacks: dict[tuple[Any, ...], Stack] = {}

    def get(self, tp: int = 2, env: dict[str, str] | None = None) -> Stack:
        key = (tp, tuple(sorted((env or {}).items())))
        if key not in self.stacks:
            tmp = Path(self.tmp.mktemp("shared-stack"))
            self.stacks[key] = start_stack(tmp, self.nats_url, tp=tp, env=env)
        return self.stacks[key]

    def lend(self, tp: int = 2, env: dict[str, str] | None = None) -> Iterator[Stack]:
        s = self.get(tp, env)
        found = s.status()
        yield s
        st = s.status()
        if st["state"] != "running":  # put it back, so that the next module is not failed too
            with s.client() as c:
                if st["state"] == "sleeping":
                    c.post("/v1/wakeup")
                c.post("/v1/resume")
        assert (st["state"], st["weight_version"]) == ("running", found["weight_version"]), (
            "a module left the shared stack changed",
            st["state"],
            st["weight_version"],
        )

    def stop(self) -> None:
        for s in self.stacks.values():
            s.stop()


@pytest.fixture(scope="session")
def shared_stacks(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedStacks]:
    stacks = SharedStacks(nats_url, tmp_path_factory)
    try:
        yield stacks
    finally:
        stacks.stop()


@pytest.fixture(scope="module")
def stack(shared_stacks: SharedStacks) -> Iterator[Stack]:
    """The session's tp=2 stack (512 KV blocks), shared by the modules that use it
    (test_control, test_generation, test_soak, test_restore): each leaves it running, awake, on its
    version."""
    yield from shared_stacks.lend(tp=2, env={"ROLLBUS_KV_CACHE_BLOCKS": "512"})
