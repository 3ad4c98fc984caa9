"""nats-server started from the configs in ``infra/nats/`` (as an operator would), on free
ports and temporary stores: the external-server and cluster setups the tests run against."""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services import natsd
from shared import creds
from shared.bus import Bus

INFRA = Path(__file__).resolve().parents[1] / "infra" / "nats"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def role_passwords() -> dict[str, str]:
    # a letter first: nats-server parses an environment value ("-1abc", "2x" are numbers)
    return {r: "p" + secrets.token_urlsafe(16) for r in creds.ROLES}


def password_env(passwords: dict[str, str]) -> dict[str, str]:
    """What infra/nats/auth.conf reads: ``ROLLBUS_NATS_PASSWORD_<ROLE>``."""
    return {f"ROLLBUS_NATS_PASSWORD_{r.upper()}": p for r, p in passwords.items()}


def write_creds_dir(d: Path, passwords: dict[str, str]) -> Path:
    """A ``ROLLBUS_NATS_CREDS_DIR`` for those passwords (one ``role:password`` file each)."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for r, p in passwords.items():
        (d / r).write_text(f"{r}:{p}\n")
        os.chmod(d / r, 0o600)
    return d


@dataclass
class Node:
    conf: Path
    env: dict[str, str]
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=lambda: Path(os.devnull))

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, wait_s: float = 20.0) -> None:
        out = open(self.log, "ab")  # noqa: SIM115 - kept open by the child
        self.proc = subprocess.Popen(
            [natsd.find_binary(), "-c", str(self.conf)],
            env={**os.environ, **self.env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log.read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"nats-server on {self.port} did not start")

    def kill(self, sig: int = 9) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def single_with_auth(tmp: Path, passwords: dict[str, str]) -> Node:
    """infra/nats/single.conf (it includes auth.conf, copied beside it), on a free port."""
    shutil.copy(INFRA / "auth.conf", tmp / "auth.conf")
    port = free_port()
    text = (INFRA / "single.conf").read_text()
    text = text.replace("listen: 127.0.0.1:4222", f"listen: 127.0.0.1:{port}")
    text = text.replace('store_dir: ".data/nats"', f'store_dir: "{tmp / "js"}"')
    conf = tmp / "single.conf"
    conf.write_text(text)
    return Node(conf, password_env(passwords), port, log=tmp / "nats.log")


ROUTE_PASSWORD_ENV = "ROLLBUS_NATS_ROUTE_PASSWORD"


def cluster(tmp: Path, passwords: dict[str, str], route_password: str = "") -> list[Node]:
    """The three infra/nats/cluster-N.conf nodes on free ports (auth.conf included by them),
    their routes authenticated with ``route_password`` (a random one by default): the
    environment the configs read (``ROLLBUS_NATS_ROUTE_PASSWORD``, ``ROLLBUS_NATS_ROUTE_N``)."""
    pw = route_password or "p" + secrets.token_urlsafe(16)
    shutil.copy(INFRA / "auth.conf", tmp / "auth.conf")
    client = [free_port() for _ in range(3)]
    route = [free_port() for _ in range(3)]
    route_env = {ROUTE_PASSWORD_ENV: pw}
    for j in range(3):
        route_env[f"ROLLBUS_NATS_ROUTE_{j + 1}"] = (
            f"nats-route://rollbus_route:{pw}@127.0.0.1:{route[j]}"
        )
    nodes = []
    for i in range(3):
        text = (INFRA / f"cluster-{i + 1}.conf").read_text()
        for j in range(3):
            text = text.replace(f"127.0.0.1:{4222 + j}", f"127.0.0.1:{client[j]}")
            text = text.replace(f"127.0.0.1:{6222 + j}", f"127.0.0.1:{route[j]}")
        text = re.sub(r'store_dir: "[^"]*"', f'store_dir: "{tmp / f"n{i + 1}"}"', text)
        conf = tmp / f"cluster-{i + 1}.conf"
        conf.write_text(text)
        env = {**password_env(passwords), **route_env}
        nodes.append(Node(conf, env, client[i], log=tmp / f"n{i + 1}.log"))
    return nodes


def server_name_of(info: dict[str, object]) -> str:
    return str(info.get("server_name") or json.dumps(info))


def single_with_perms(tmp: Path, passwords: dict[str, str], perms: dict[str, Any]) -> Node:
    """:func:`single_with_auth` with ``perms`` (role -> nats-server permissions) in place
    of those roles' generated ones: e.g. a grant taken away (:func:`without`), as in an
    auth.conf edited by hand or one older than the code."""
    node = single_with_auth(tmp, passwords)
    text, stock = natsd.auth_conf(), natsd.permissions()
    for role, p in perms.items():
        old = json.dumps(stock[role])
        if old not in text:
            raise ValueError(f"role {role!r} not found in the generated auth.conf")
        text = text.replace(old, json.dumps(p))
    (tmp / "auth.conf").write_text(text)
    return node


def without(role: str, *subjects: str) -> dict[str, Any]:
    """``role``'s generated permissions with the publish grants ``subjects`` removed."""
    perms = copy.deepcopy(natsd.permissions()[role])
    pub = perms["publish"]
    allow = pub["allow"] if isinstance(pub, dict) else pub
    for s in subjects:
        allow.remove(s)  # ValueError: not a grant of this role (the test is wrong)
    return perms


@asynccontextmanager
async def role_buses(
    tmp: Path, roles: Sequence[str], perms: dict[str, Any] | None = None
) -> AsyncIterator[tuple[Node, dict[str, Bus]]]:
    """A started :func:`single_with_auth` server (:func:`single_with_perms` with ``perms``:
    a grant taken away) and a bus connected to it as each of ``roles`` (client name
    ``test-<role>``): ``(node, {role: bus})``. The buses closed and the server stopped at
    the end (a test may stop and start the node meanwhile)."""
    passwords = role_passwords()
    if perms is None:
        node = single_with_auth(tmp, passwords)
    else:
        node = single_with_perms(tmp, passwords, perms)
    node.start()
    buses: dict[str, Bus] = {}
    try:
        for role in roles:
            url = f"nats://{role}:{passwords[role]}@127.0.0.1:{node.port}"
            buses[role] = await Bus.connect(url, f"test-{role}")
        yield node, buses
    finally:
        for b in buses.values():
            await b.close()
        node.stop()
