"""A real rollbus stack for e2e tests: ``rollbus serve`` as a subprocess.

It uses the session's nats-server (``ROLLBUS_NATS_URL``) and a unique instance, so
several stacks can share one server without seeing each other.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

# free_port and wait_healthy are the tests' too (imported from here)
from services.serveproc import free_port, serve_env, spawn, wait_healthy
from services.serveproc import stop as stop_serve
from tests.natsconf import Node


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    base_url: str
    instance: str
    model_dir: Path
    nats_url: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=kw.pop("timeout", 60), **kw)

    def status(self) -> dict[str, Any]:
        with self.client() as c:
            r = c.get("/v1/status")
            r.raise_for_status()
            return dict(r.json())

    def metric(self, prefix: str) -> float:
        """The sum of every /metrics sample whose line starts with ``prefix`` (a name,
        or a name with its labels)."""
        with self.client() as c:
            text = c.get("/metrics").text
        return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(prefix))

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int:
        return stop_serve(self.proc)

    def restart(self) -> None:
        """Stop and start it again in place (same settings, port, instance and data dir):
        for a module's shared stack a failed test left in a state nothing else undoes."""
        self.stop()
        self.proc = spawn(self.env, self.log, append=True)
        try:
            wait_healthy(self.base_url, self.proc, self.log)
        except BaseException:
            stop_serve(self.proc)
            raise


def start_stack(
    tmp: Path,
    nats_url: str | None,
    *,
    tp: int = 2,
    model_config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    model_name: str = "tiny",
    model_dir: Path | None = None,
) -> Stack:
    """``model_dir``: serve that existing model dir (e.g. a transformers checkpoint)
    instead of creating a tiny model under ``tmp``."""
    from services.tiny_model import create_model_dir

    tmp.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir or tmp / "models" / model_name
    if not (model_dir / "config.json").exists():
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        create_model_dir(model_dir, model_config, seed=0)
    port = free_port()
    instance = f"t{uuid.uuid4().hex[:8]}"
    full_env = serve_env(
        ROLLBUS_INSTANCE=instance,
        ROLLBUS_API_PORT=str(port),
        ROLLBUS_MODEL=str(model_dir),
        ROLLBUS_DATA_DIR=str(tmp / "data"),
        ROLLBUS_TP=str(tp),
        ROLLBUS_CONTROL_TIMEOUT_S="8",
        ROLLBUS_KV_CACHE_BLOCKS="64",
        ROLLBUS_LOG_LEVEL="warning",
    )
    if nats_url:
        full_env["ROLLBUS_NATS_URL"] = nats_url
    full_env.update(env or {})
    log = tmp / f"stack-{instance}.log"
    proc = spawn(full_env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
    except RuntimeError as e:
        health = last_health(base)
        exited = proc.poll()  # the launcher's own exit code, before we stop it
        # the launcher's ordered stop (its ranks and their shared-memory files too), waited
        # for: the next start must not share the host with this one's leftovers
        stop_serve(proc)
        raise StackStartError(str(e), log, start_report(log, tp, health), exited) from None
    except BaseException:
        stop_serve(proc)
        raise
    return Stack(proc, base, instance, model_dir, nats_url or "", log, full_env)


class StackStartError(RuntimeError):
    """A stack that did not get healthy (stopped since): ``report`` says how far each
    rank got (:func:`start_report`), ``log`` is the stack's log, ``exited`` the launcher's
    exit code if it exited by itself (2: a configuration error) or None."""

    def __init__(self, message: str, log: Path, report: str, exited: int | None = None) -> None:
        super().__init__(f"{message}\n{report}")
        self.log, self.report, self.exited = log, report, exited


# a rank's start phases (services.worker.main, INFO) and the launcher's own lines
RANK_PHASE = re.compile(r"rank (\d+) (start: .*|ready: .*)$")
LAUNCHER_LINE = re.compile(r"^(rollbus: |rollbus-worker rank \d+: )")


def last_health(base_url: str) -> str:
    """What ``GET /health`` answers now, in one line."""
    try:
        r = httpx.get(base_url + "/health", timeout=2)
    except httpx.HTTPError as e:
        return f"no answer ({type(e).__name__})"
    return f"{r.status_code} {r.text.strip()[:300]}"


def start_report(log: Path, tp: int, health: str = "") -> str:
    """Where a start stopped, from its log: the last start phase of each rank (logged at
    ``ROLLBUS_LOG_LEVEL=info``; none: still importing paddle or connecting to NATS), the
    launcher's lines (a rank that failed and was restarted) and ``/health``'s answer."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    phase: dict[int, str] = {}
    launcher: list[str] = []
    for ln in lines:
        if m := RANK_PHASE.search(ln):
            phase[int(m.group(1))] = m.group(2)
        elif LAUNCHER_LINE.match(ln):
            launcher.append(ln)
    out = [
        f"rank {r}: {phase.get(r, 'no start phase logged (importing paddle / connecting)')}"
        for r in range(tp)
    ]
    out += launcher[-6:]
    if health:
        out.append(f"/health: {health}")
    return "\n".join(out)


@contextmanager
def running_stack(tmp: Path, nats_url: str | None, **kw: Any) -> Iterator[Stack]:
    stack = start_stack(tmp, nats_url, **kw)
    try:
        yield stack
    finally:
        stack.stop()


@contextmanager
def module_stack(
    tmp_path_factory: pytest.TempPathFactory, nats_url: str | None, name: str, **kw: Any
) -> Iterator[Stack]:
    """A module fixture's stack: a temp dir of its own and a model named ``name-<hex>``, so
    versions published to it never meet another module's on the session's server."""
    tmp = Path(tmp_path_factory.mktemp(name))
    with running_stack(tmp, nats_url, model_name=f"{name}-{uuid.uuid4().hex[:6]}", **kw) as s:
        yield s


@contextmanager
def small_payload_stack(
    tmp_path_factory: pytest.TempPathFactory, name: str, max_payload: int, **kw: Any
) -> Iterator[Stack]:
    """A module fixture's stack (:func:`module_stack`) on a NATS server of its own whose
    ``max_payload`` is ``max_payload`` bytes: messages that fit the default 1 MiB but not a
    smaller limit are what the tests of step and reply sizes need."""
    tmp = Path(tmp_path_factory.mktemp(f"{name}-nats"))
    port = free_port()
    conf = tmp / "server.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{port}\nmax_payload: {max_payload}\n"
        f'jetstream {{ store_dir: "{tmp / "js"}" }}\n'
    )
    node = Node(conf, {}, port, log=tmp / "nats.log")
    node.start()
    try:
        with module_stack(tmp_path_factory, node.url, name, **kw) as s:
            yield s
    finally:
        node.stop()


def model_config(model_dir: Path) -> dict[str, Any]:
    return dict(json.loads((model_dir / "config.json").read_text()))
