"""Helpers of the fault tests: signals, waiting for the stack, per-rank versions and
greedy output against the in-process reference."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any

import httpx

from services import natsd
from shared import sharding
from shared.model_config import ModelConfig
from tests.e2e.reference import greedy
from tests.e2e.stack import Stack, free_port, model_config, start_stack

CT = 6.0  # ROLLBUS_CONTROL_TIMEOUT_S of the fault stack
DELAY = 1.5  # ROLLBUS_TEST_STAGE_DELAY_S / ROLLBUS_TEST_COMMIT_DELAY_S
MARGIN = 5.0
# the API waits 2 x CONTROL_TIMEOUT_S + 5 s for an engine reply (stage, then commit)
CONTROL_BOUND = 2 * CT + 5 + MARGIN
# a generation stream hears from the engine at least every 30 s (heartbeats), and a
# failed step ends it after CONTROL_TIMEOUT_S
GEN_BOUND = 30 + CT + MARGIN
# the engine probes every live request's reply inbox every 2 s (1 s probe timeout) and
# cancels after two no-responders in a row (services/engine/orphans.py)
ORPHAN_BOUND = 2 * 2 + 1 + MARGIN
PROMPT = "rollout"
PROMPT_IDS = [256, *PROMPT.encode()]
N_GREEDY = 8


def ctl(stack: Stack, path: str, timeout: float = CONTROL_BOUND + 30, **kw: Any) -> httpx.Response:
    with httpx.Client(base_url=stack.base_url, timeout=timeout) as cl:
        return cl.post(path, **kw)


def get(stack: Stack, path: str, timeout: float = 30) -> httpx.Response:
    with httpx.Client(base_url=stack.base_url, timeout=timeout) as cl:
        return cl.get(path)


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_exited(pid: int, timeout: float = 10) -> None:
    """Until ``pid`` has exited — every thread gone, a zombie its parent has not reaped
    (what a pidfd polls readable for): SIGKILL is delivered asynchronously, and a process
    with many threads and much memory takes a while to die on a loaded host."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        if not poll.poll(timeout * 1000):
            raise AssertionError(f"process {pid} still running {timeout} s after SIGKILL")
    finally:
        os.close(fd)


def child_pid(launcher: int, pattern: str) -> int:
    """The pid of the one child of ``launcher`` whose command line matches ``pattern``."""
    out = subprocess.run(
        ["pgrep", "-P", str(launcher), "-f", pattern], capture_output=True, text=True
    ).stdout.split()
    assert len(out) == 1, (pattern, out)
    return int(out[0])


def status(stack: Stack, fresh: bool = False) -> dict[str, Any]:
    """``fresh``: every rank asked now, not the engine's view (up to ~1 s behind a kill)."""
    r = get(stack, "/v1/status?fresh=true" if fresh else "/v1/status")
    assert r.status_code == 200, r.text
    return dict(r.json())


def rank_pids(stack: Stack, quiet: bool = False) -> list[int]:
    try:
        return [int(r["pid"]) for r in status(stack)["ranks"] if r.get("alive")]
    except (AssertionError, httpx.HTTPError):
        if quiet:
            return []
        raise


def rank_pid(stack: Stack, rank: int) -> int:
    st = status(stack)
    return int(next(r["pid"] for r in st["ranks"] if r.get("rank") == rank))


def log_count(stack: Stack, needle: str) -> int:
    return stack.log.read_text(errors="replace").count(needle)


def wait_log(stack: Stack, needle: str, before: int, timeout: float = 60) -> None:
    """Wait until ``needle`` appears in the stack log more often than ``before``."""
    deadline = time.monotonic() + timeout
    while log_count(stack, needle) <= before:
        assert time.monotonic() < deadline, f"{needle!r} not logged:\n{stack.log_tail()}"
        time.sleep(0.02)


def engine_requests(stack: Stack) -> int:
    """Requests the engine holds (running or queued), asked through the API (the new one
    once the launcher restarted it)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            st = status(stack)
            return int(st["running"]) + int(st["waiting"])
        except (AssertionError, OSError, httpx.HTTPError):
            assert time.monotonic() < deadline, stack.log_tail()
            time.sleep(0.2)


def wait_recovered(stack: Stack, timeout: float = 150) -> dict[str, Any]:
    """Wait until /health is 200 and every rank answers on the engine's version."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        assert stack.proc.poll() is None, f"the stack stopped:\n{stack.log_tail()}"
        try:
            h = get(stack, "/health", timeout=10)
            if h.status_code == 200:
                st = status(stack, fresh=True)  # a rank killed a moment ago does not answer
                vers = {r.get("version") for r in st["ranks"]}
                if all(r.get("alive") for r in st["ranks"]) and vers == {st["weight_version"]}:
                    return st
                last = st
            else:
                last = h.text
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.3)
    raise AssertionError(f"not recovered in {timeout}s: {last}\n{stack.log_tail()}")


# versions published to the object store by the tests: version -> init_weights seed
PUBLISHED = {"p1": 11}


@cache
def _reference(model_dir: str, version: str) -> tuple[int, ...]:
    d = Path(model_dir)
    if version in PUBLISHED:
        cfg = ModelConfig.from_hf(model_config(d))
        weights = sharding.init_weights(cfg, PUBLISHED[version])
        return tuple(greedy(d, PROMPT_IDS, N_GREEDY, weights=weights))
    wdir = d if version == "v0" else d / "versions" / version
    return tuple(greedy(d, PROMPT_IDS, N_GREEDY, weights_dir=wdir))


def publish(stack: Stack, nats_url: str, version: str) -> None:
    """Publish ``version`` (weights of seed ``PUBLISHED[version]``) to the object store."""
    from services.trainer.publisher import CheckpointPublisher

    cfg = model_config(stack.model_dir)
    state = sharding.init_weights(ModelConfig.from_hf(cfg), PUBLISHED[version])
    CheckpointPublisher(nats_url).publish("tiny", version, state, tp=2, config=cfg)


def reference(stack: Stack, version: str) -> list[int]:
    """Greedy tokens of ``version`` computed in this process (tp=1, no bus)."""
    return list(_reference(str(stack.model_dir), version))


def greedy_tokens(stack: Stack) -> tuple[str, list[int]] | None:
    """The greedy completion's version label and token ids; None for a 503."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": N_GREEDY,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with httpx.Client(base_url=stack.base_url, timeout=GEN_BOUND) as cl:
        r = cl.post("/v1/completions", json=body)
    if r.status_code == 503:
        return None
    assert r.status_code == 200, r.text
    out = r.json()
    return str(out.get("weight_version", "")), list(out["choices"][0]["token_ids"])


def assert_consistent(stack: Stack, version: str, timeout: float = 150) -> None:
    """Engine and every rank on ``version``; a greedy request answers ``version``'s
    reference tokens (the engine must be running). Until the stack serves again (e.g. a
    rank still inside a step lost in an outage, until it leaves and is restarted), a
    request may answer 503: it is sent again."""
    deadline = time.monotonic() + timeout
    while True:
        st = wait_recovered(stack)
        assert st["weight_version"] == version, st
        assert [r["version"] for r in st["ranks"]] == [version] * len(st["ranks"]), st
        got = greedy_tokens(stack)
        if got is not None:
            break
        assert time.monotonic() < deadline, f"not serving again:\n{stack.log_tail()}"
        time.sleep(1)
    label, tokens = got
    assert tokens == reference(stack, version), (label, tokens)
    assert label in ("", version)


class Call(threading.Thread):
    """A control call in a thread; ``response`` and ``seconds`` once joined."""

    def __init__(self, stack: Stack, path: str, **kw: Any) -> None:
        super().__init__(daemon=True)
        self.stack, self.path, self.kw = stack, path, kw
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.seconds = 0.0
        self.start()

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            self.response = ctl(self.stack, self.path, **self.kw)
        except Exception as e:  # noqa: BLE001 - asserted by the test
            self.error = e
        self.seconds = time.monotonic() - t0

    def result(self, bound: float) -> httpx.Response:
        """Joined within ``bound`` seconds of its start (else the call hung)."""
        self.join(bound + 30)
        assert not self.is_alive(), f"{self.path} did not answer within {bound + 30}s"
        assert self.error is None, repr(self.error)
        assert self.response is not None
        assert self.seconds <= bound, f"{self.path} took {self.seconds:.1f}s > {bound}s"
        return self.response


class Stream(threading.Thread):
    """A long streamed completion: ``tokens`` so far, ``outcome`` ("done", "error" with
    ``error``, or "cut": the connection ended without either) once joined."""

    def __init__(self, stack: Stack, max_tokens: int = 1500) -> None:
        super().__init__(daemon=True)
        self.stack, self.max_tokens = stack, max_tokens
        self.tokens = 0
        self.outcome = ""
        self.error: Any = None
        self.status = 0
        self.seconds = 0.0
        self.ended_at = 0.0
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.monotonic()
        try:
            with (
                httpx.Client(base_url=self.stack.base_url, timeout=GEN_BOUND + 30) as cl,
                cl.stream("POST", "/v1/completions", json=body) as r,
            ):
                self.status = r.status_code
                if r.status_code != 200:
                    self.outcome, self.error = "error", r.read().decode()
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        self.outcome = self.outcome or "done"
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        self.outcome, self.error = "error", ev["error"]
                        continue
                    self.tokens += 1
                    self.started.set()
                self.outcome = self.outcome or "cut"
        except httpx.HTTPError as e:
            self.outcome, self.error = "cut", repr(e)
        finally:
            self.ended_at = time.monotonic()
            self.seconds = self.ended_at - t0
            self.started.set()

    def result(self, bound: float = GEN_BOUND) -> Stream:
        self.join(bound + 30)
        assert not self.is_alive(), "the stream never ended"
        return self


def sig_name(sig: int) -> str:
    return signal.Signals(sig).name


class NatsProc:
    """A nats-server on a fixed port and store, killed and started again by tests."""

    def __init__(self, store: Path, log: Path, conf: str = "") -> None:
        """``conf``: server configuration text (e.g. a short ``ping_interval``)."""
        self.store, self.log, self.port = store, log, free_port()
        self.conf = log.with_suffix(".conf") if conf else None
        if self.conf is not None:
            self.conf.write_text(conf)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, wait_s: float = 20.0) -> None:
        cmd = [natsd.find_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js"]
        cmd += ["-sd", str(self.store)]
        if self.conf is not None:
            cmd += ["-c", str(self.conf)]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"nats-server exited: {self.log.read_text()[-2000:]}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not listen in time")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def fault_stack(tmp: Path, nats: NatsProc, **env: str) -> Stack:
    """A tp=2 stack on ``nats`` as the fault tests want it: versions loaded from the object
    store (falling back to snapshot dirs), a ``CT`` control timeout, a 3 s stall timeout,
    a ``DELAY`` window before every commit; ``env`` on top. ``nats`` is stopped if the
    stack does not start (no fixture teardown runs then)."""
    try:
        return start_stack(
            tmp,
            nats.url,
            tp=2,
            env={
                "ROLLBUS_LOAD_STRATEGY": "object_store",
                "ROLLBUS_CONTROL_TIMEOUT_S": str(CT),
                # a rank left inside a step its peer never got (a step lost in a NATS
                # outage) leaves after max(4 x STALL_S, 4 x CT) = 24 s; the launcher then
                # restarts the ranks
                "ROLLBUS_STALL_S": "3",
                "ROLLBUS_KV_CACHE_BLOCKS": "96",
                "ROLLBUS_TEST_COMMIT_DELAY_S": str(DELAY),
                **env,
            },
        )
    except Exception:
        nats.stop()
        raise


class Faults:
    def __init__(self, stack: Stack, nats: NatsProc) -> None:
        self.stack, self.nats = stack, nats
