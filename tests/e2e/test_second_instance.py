"""A second `rollbus serve` beside the first: same DATA_DIR (embedded nats-server, its
generated credentials), another instance name and API port. It joins the running
server instead of starting one; both serve generations and control independently; a
duplicate instance name is refused (one line, exit 2); stopping the second leaves the
first intact; stopping the first (the server's owner) hands the server over to a third,
joined beside the second (started with it: one start less than a restart of the second),
which keeps serving."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from services.serveproc import free_port, serve_env, spawn, wait_healthy
from services.serveproc import stop as stop_serve
from tests.e2e.procs import alive


def _children(pid: int) -> list[str]:
    """Command lines of a process's children."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for kid in (task / "children").read_text().split():
            try:
                out.append(Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return out


class Serve:
    def __init__(self, tmp: Path, instance: str, nats_port: int) -> None:
        self.instance, self.api = instance, free_port()
        self.base = f"http://127.0.0.1:{self.api}"
        self.log = tmp / f"serve-{instance}-{self.api}.log"
        env = serve_env(
            ROLLBUS_INSTANCE=instance,
            ROLLBUS_API_PORT=str(self.api),
            ROLLBUS_NATS_PORT=str(nats_port),
            ROLLBUS_DATA_DIR=str(tmp / "data"),
            ROLLBUS_TP="1",
            ROLLBUS_CONTROL_TIMEOUT_S="8",
            ROLLBUS_KV_CACHE_BLOCKS="64",
            ROLLBUS_LOG_LEVEL="warning",
        )
        self.proc = spawn(env, self.log, cwd=tmp)

    def healthy(self) -> None:
        wait_healthy(self.base, self.proc, self.log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def complete(self) -> dict[str, object]:
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        r = httpx.post(self.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def post(self, path: str, **kw: object) -> httpx.Response:
        return httpx.post(self.base + path, timeout=60, **kw)  # type: ignore[arg-type]

    def status(self) -> dict[str, object]:
        return dict(httpx.get(self.base + "/v1/status", timeout=30).json())

    def stop(self) -> int:
        return stop_serve(self.proc)


def test_second_instance_joins_the_embedded_server(tmp_path: Path) -> None:
    nport = free_port()
    first = Serve(tmp_path, "first", nport)
    second: Serve | None = None
    third: Serve | None = None
    try:
        first.healthy()
        nats_pid = json.loads((tmp_path / "data" / "nats" / "owner.json").read_text())["nats_pid"]
        assert any("nats-server" in c for c in _children(first.proc.pid))
        second = Serve(tmp_path, "second", nport)
        third = Serve(tmp_path, "third", nport)
        second.healthy()
        third.healthy()
        assert "joined the embedded nats-server" in second.text()
        assert "joined the embedded nats-server" in third.text()
        kids = _children(second.proc.pid)
        # its engine, one rank, its api: no nats-server of its own
        assert len(kids) == 3 and not any("nats-server" in c for c in kids), kids
        assert second.status()["nats_url"] == first.status()["nats_url"]
        assert second.status()["instance"] == "second"

        # both generate; control is per instance
        assert first.complete()["choices"] and second.complete()["choices"]
        assert first.post("/v1/pause", params={"mode": "keep"}).status_code == 200
        assert first.status()["is_paused"] is True
        assert second.status()["is_paused"] is False
        assert second.complete()["choices"]
        assert second.post("/v1/sleep", params={"tags": "kv_cache"}).status_code == 200
        assert first.status()["state"] == "paused" and second.status()["state"] == "sleeping"
        assert second.post("/v1/wakeup").status_code == 200
        assert first.post("/v1/resume").status_code == 200
        assert first.complete()["choices"] and second.complete()["choices"]

        # the same instance name again: one line, exit 2, nothing of the first disturbed
        dup = Serve(tmp_path, "first", nport)
        assert dup.proc.wait(60) == 2
        lines = [x for x in dup.text().splitlines() if x.strip()]
        assert any("instance 'first' is already running" in x for x in lines), lines
        assert not any("Traceback" in x for x in lines), lines
        assert first.complete()["choices"]

        # stopping the second leaves the first and its nats-server intact
        assert second.stop() == 0
        (stopped,) = [x for x in second.text().splitlines() if x.startswith("rollbus: stopped")]
        assert "worker rank 0" in stopped and "nats-server" not in stopped, stopped
        assert alive(nats_pid)
        assert first.complete()["choices"] and first.status()["state"] == "running"
        assert httpx.get(first.base + "/health", timeout=5).status_code == 200

        # the first (the server's owner) stops: a joined instance takes the server over
        assert third.complete()["choices"]
        assert first.stop() == 0
        assert not alive(nats_pid)
        deadline = time.monotonic() + 60
        while "this instance runs it now" not in third.text():
            assert time.monotonic() < deadline, third.text()[-2000:]
            time.sleep(0.2)
        wait_healthy(third.base, third.proc, third.log, timeout=60)
        assert third.complete()["choices"]
        owner = json.loads((tmp_path / "data" / "nats" / "owner.json").read_text())
        assert owner["instance"] == "third" and alive(owner["nats_pid"])
        assert third.stop() == 0
        assert not alive(owner["nats_pid"])
        assert not (tmp_path / "data" / "nats" / "owner.json").exists()
    finally:
        for s in (third, second, first):
            if s is not None:
                s.stop()
