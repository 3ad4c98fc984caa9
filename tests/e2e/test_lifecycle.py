"""Lifecycle of `rollbus serve` as a terminal drives it: Ctrl-C to the whole foreground
process group, SIGTERM, an immediate restart on the same ports, start-up errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from services.serveproc import serve_env, spawn
from services.tiny_model import create_model_dir
from tests.e2e.procs import alive, descendants
from tests.e2e.stack import free_port, wait_healthy

STOP_S = 10.0


def _env(**kw: str) -> dict[str, str]:
    return serve_env(ROLLBUS_LOG_LEVEL="warning", **kw)


def _serve(cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`rollbus serve` as a shell starts it: its own process group (the terminal's
    foreground group), with the embedded nats-server unless the env names a URL."""
    return spawn(env, log, cwd, append=True, start_new_session=True)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _roles(launcher: int, status: dict[str, object]) -> dict[str, int]:
    """Every process of the stack by role, from the process tree and /v1/status."""
    roles = {"launcher": launcher}
    for pid in descendants(launcher):
        cmd = _cmdline(pid)
        if "nats-server" in cmd:
            roles["nats-server"] = pid
        elif "services.engine" in cmd:
            roles["engine"] = pid
        elif "services.api" in cmd:
            roles["api"] = pid
        elif "services.worker" in cmd:
            rank = cmd.split("--rank", 1)[1].split()[0]
            roles[f"rank{rank}"] = pid
    for r in status["ranks"]:  # type: ignore[attr-defined]
        assert roles[f"rank{r['rank']}"] == r["pid"]
    return roles


def _watch_deaths(pids: dict[str, int]) -> tuple[dict[str, float], threading.Event]:
    """Record when each process dies (exits or turns zombie), polling every 5 ms."""
    died: dict[str, float] = {}
    done = threading.Event()

    def run() -> None:
        while not done.is_set() and len(died) < len(pids):
            now = time.monotonic()  # one time per pass: deaths seen together tie
            for role, pid in pids.items():
                if role not in died and not alive(pid):
                    died[role] = now
            time.sleep(0.005)

    threading.Thread(target=run, daemon=True).start()
    return died, done


def _time_wait_ports() -> set[int]:
    out: set[int] = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(f).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            parts = ln.split()
            if parts[3] == "06":  # TCP_TIME_WAIT
                out.add(int(parts[1].rsplit(":", 1)[1], 16))
    return out


def _linger(port: int) -> socket.socket:
    """A connection the server will close at its stop: its port then sits in TIME_WAIT."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.recv(1)  # nats: INFO; http: nothing until closed -> timeout is fine below
    return s


def _open_stream(base: str) -> tuple[list[str], threading.Event, threading.Thread]:
    """A long streamed completion on a thread: (its SSE lines, set at the first token)."""
    lines: list[str] = []
    got = threading.Event()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1500, "ignore_eos": True}

    def run() -> None:
        try:
            with httpx.stream(
                "POST", base + "/v1/completions", json={**body, "stream": True}, timeout=30
            ) as r:
                for ln in r.iter_lines():
                    if ln:
                        lines.append(ln)
                        got.set()
        except httpx.HTTPError as e:
            lines.append(f"cut off: {e!r}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lines, got, t


def test_ctrl_c_stops_in_order_quietly_and_restarts_on_the_same_ports(tmp_path: Path) -> None:
    api, nport = free_port(), free_port()
    env = _env(
        ROLLBUS_API_PORT=str(api),
        ROLLBUS_NATS_PORT=str(nport),
        ROLLBUS_DATA_DIR=str(tmp_path / "data"),
    )
    log = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{api}"
    proc = _serve(tmp_path, env, log)
    try:
        wait_healthy(base, proc, log)
        roles = _roles(proc.pid, httpx.get(base + "/v1/status", timeout=10).json())
        assert set(roles) == {"launcher", "nats-server", "engine", "api", "rank0", "rank1"}
        # connections the servers close at their stop leave their ports in TIME_WAIT
        held = [_linger(nport)]
        http = httpx.Client(base_url=base, timeout=10)
        assert http.get("/v1/is_paused").status_code == 200  # a kept-alive connection
        streams = [_open_stream(base) for _ in range(3)]  # generating at the Ctrl-C
        for _, got, _ in streams:
            assert got.wait(30), "no token streamed"
        died, done = _watch_deaths(roles)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        code = proc.wait(STOP_S)
        while len(died) < len(roles) and time.monotonic() - t0 < STOP_S:
            time.sleep(0.01)
        done.set()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text(errors="replace")
    assert code == 0, out
    assert set(died) == set(roles), f"still alive: {set(roles) - set(died)}"
    assert max(died.values()) - t0 < STOP_S
    assert "Traceback" not in out and "ERROR:" not in out, out
    order = sorted(died, key=lambda r: died[r])
    last_rank = max(died["rank0"], died["rank1"])
    assert died["api"] <= died["engine"] <= min(died["rank0"], died["rank1"]), order
    assert last_rank <= died["nats-server"], order
    assert "stopped api, engine, worker rank 0, worker rank 1, nats-server" in out
    for lines, _, t in streams:  # each open stream was ended properly, not cut off
        t.join(10)
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        assert any("shutting down" in ln for ln in lines), lines[-3:]

    for s in held:
        s.close()
    http.close()
    assert {nport, api} & _time_wait_ports(), "no TIME_WAIT socket: the restart proves nothing"
    # `just run` again at once: the same ports, TIME_WAIT sockets and all
    log2 = tmp_path / "serve2.log"
    proc = _serve(tmp_path, env, log2)
    try:
        wait_healthy(base, proc, log2)
        roles = _roles(proc.pid, httpx.get(base + "/v1/status", timeout=10).json())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # SIGTERM to the launcher alone: same stop
        code = proc.wait(STOP_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log2.read_text(errors="replace")
    assert code == 0 and "Traceback" not in out and "busy" not in out, out
    time.sleep(0.2)
    assert not [r for r, pid in roles.items() if alive(pid)]


def _run(tmp_path: Path, env: dict[str, str], timeout: float = 120) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def _quiet(out: str) -> list[str]:
    """Our own lines: paddle's import banners and INFO chatter left out."""
    return [
        ln
        for ln in out.splitlines()
        if ln.strip() and not ln.startswith(("=", "FLAGS(")) and "INFO" not in ln
    ]


def test_unsupported_model_config_is_one_line_exit_2_no_rank_start(
    tmp_path: Path, nats_url: str
) -> None:
    model = create_model_dir(tmp_path / "m", seed=0)
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}  # a RoPE rollbus lacks
    (model / "config.json").write_text(json.dumps(cfg))
    env = _env(
        ROLLBUS_NATS_URL=nats_url,
        ROLLBUS_API_PORT=str(free_port()),
        ROLLBUS_MODEL=str(model),
        ROLLBUS_DATA_DIR=str(tmp_path / "d"),
        ROLLBUS_INSTANCE=f"badcfg{os.getpid()}",
    )
    code, out, _ = _run(tmp_path, env)
    lines = _quiet(out)
    assert code == 2, out
    assert len(lines) == 1 and "rope_scaling.rope_type='yarn'" in lines[0], out
    assert "Traceback" not in out and "worker rank" not in out


def test_model_the_ranks_cannot_load_exits_2_and_is_not_retried(
    tmp_path: Path, nats_url: str
) -> None:
    model = create_model_dir(tmp_path / "m", seed=0)
    (model / "model.safetensors").write_bytes(b"\x00" * 64)  # config fine, weights not
    env = _env(
        ROLLBUS_NATS_URL=nats_url,
        ROLLBUS_API_PORT=str(free_port()),
        ROLLBUS_MODEL=str(model),
        ROLLBUS_DATA_DIR=str(tmp_path / "d"),
        ROLLBUS_INSTANCE=f"badw{os.getpid()}",
    )
    code, out, _ = _run(tmp_path, env)
    lines = _quiet(out)
    assert code == 2, out
    assert "restarting the ranks" not in out and "Traceback" not in out, out
    ours = [ln for ln in lines if ln.startswith("rollbus:")]
    assert len(ours) == 1 and "configuration error (not retried" in ours[0], out
    rank_lines = [ln for ln in lines if ln.startswith("rollbus-worker")]
    assert rank_lines and all("cannot start" in ln for ln in rank_lines), out


def test_api_and_engine_alone_stop_quietly_with_exit_0(tmp_path: Path, nats_url: str) -> None:
    """Each child treats SIGTERM and SIGINT as a clean stop: exit 0, no traceback."""
    model = create_model_dir(tmp_path / "m", seed=0)
    api = free_port()
    env = _env(
        ROLLBUS_NATS_URL=nats_url,
        ROLLBUS_API_PORT=str(api),
        ROLLBUS_MODEL=str(model),
        ROLLBUS_INSTANCE=f"alone{api}",
    )
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for name in ("engine", "api")
    }
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the API answers (503: no ranks) once up
            try:
                httpx.get(f"http://127.0.0.1:{api}/v1/is_paused", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        time.sleep(0.5)
        for (name, p), sig in zip(procs.items(), (signal.SIGINT, signal.SIGTERM), strict=True):
            p.send_signal(sig)
            out = p.communicate(timeout=STOP_S)[0].decode(errors="replace")
            assert p.returncode == 0, (name, p.returncode, out)
            assert "Traceback" not in out and "ERROR" not in out, (name, out)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def _catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (``SigCgt`` of /proc/pid/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _importing(pid: int) -> bool:
    """``services.cli`` is importing: its start-up stop handler is in (SIGHUP caught), or
    the imports that follow it have begun (pydantic's compiled core is mapped). Without
    the handler the second comes first, and a Ctrl-C then is a traceback."""
    if _catches(pid, signal.SIGHUP):
        return True
    try:
        return "pydantic_core" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/pid/stat): tells it from a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def test_ctrl_c_while_starting_is_a_clean_stop(tmp_path: Path) -> None:
    """Ctrl-C while importing, while starting nats-server, while the ranks load: exit 0,
    no traceback, nothing left running.

    The delays count from the moment ``services.cli`` is importing (:func:`_importing`):
    before that the interpreter itself is still starting, and a Ctrl-C there is Python's,
    not ours (on a loaded machine that takes well over the 0.3 s this test once waited).
    The stop is given more than ``STOP_S`` here: its speed is the other tests' business;
    a loaded machine stretches the imports the launcher finishes before it stops."""
    for delay in (0.0, 2.0, 5.0):
        env = _env(
            ROLLBUS_API_PORT=str(free_port()),
            ROLLBUS_NATS_PORT=str(free_port()),
            ROLLBUS_DATA_DIR=str(tmp_path / "data"),
        )
        log = tmp_path / f"serve-{delay}.log"
        proc = _serve(tmp_path, env, log)
        seen: dict[int, str | None] = {}
        deadline = time.monotonic() + 60
        while not _importing(proc.pid) and proc.poll() is None:
            assert time.monotonic() < deadline, "services.cli never started importing"
            time.sleep(0.002)
        t0 = time.monotonic()
        while True:
            for pid in descendants(proc.pid) - seen.keys():
                seen[pid] = _start_time(pid)
            if time.monotonic() - t0 >= delay:
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(STOP_S * 4)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        out = log.read_text(errors="replace")
        assert code == 0 and "Traceback" not in out, (delay, out)
        # the launcher's children (PR_SET_PDEATHSIG at the latest) go once it has exited
        left = dict(seen)
        deadline = time.monotonic() + STOP_S
        while left and time.monotonic() < deadline:
            left = {p: t for p, t in left.items() if alive(p) and _start_time(p) == t}
            time.sleep(0.05)
        assert not left, (delay, {p: _cmdline(p) for p in left}, out)
