"""A stack whose model is big enough (~100 MiB a shard) that an object-store pull takes
a while, on a nats-server of its own that a test can stop, kill and start again: shared
by the pull-failure e2e tests and the auto-update pull-retry fault test."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from services import natsd
from tests.e2e.stack import Stack, free_port, start_stack

BIG = {
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}


class Server:
    """A nats-server on a fixed port that can be restarted on the same store."""

    def __init__(self, store: Path) -> None:
        self.store, self.port = store, free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                natsd.find_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.store),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)


def big_stack(tmp: Path, server: Server, name: str, **env: str) -> Stack:
    """A tp=2 stack serving a ``BIG`` model ``name`` on ``server``, loading versions from
    the object store, with ``env`` on top. A 10 s control timeout: a pull takes a few
    seconds and the tests stall it past the reader's 5 s stall timeout, under this.
    ``server`` is stopped if the stack does not start (no fixture teardown runs then)."""
    try:
        return start_stack(
            tmp,
            server.url,
            tp=2,
            model_config=BIG,
            model_name=name,
            env={
                "ROLLBUS_LOAD_STRATEGY": "object_store",
                "ROLLBUS_CONTROL_TIMEOUT_S": "10",
                "ROLLBUS_KV_CACHE_BLOCKS": "8",
                **env,
            },
        )
    except Exception:
        server.stop()
        raise
