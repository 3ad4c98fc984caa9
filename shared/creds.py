"""NATS credentials of the five roles, URLs that carry them, and the TLS client context.

Roles: ``api``, ``engine``, ``worker``, ``trainer``, ``operator``. The NATS user name *is*
the role name (the server's permissions and each client's inbox prefix
``_INBOX_<role>`` are keyed by it). Credentials live in one directory (``DATA_DIR/creds``
by default), one private file per role holding ``user:password``: generated at the first
start of the embedded server (``secrets.token_urlsafe``; directory 0700, files 0600), or
written by an admin for an external server. They are never logged: every URL that is
printed or returned goes through :func:`redact`.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit, urlunsplit

if TYPE_CHECKING:
    from shared.settings import Settings

ROLES = ("api", "engine", "worker", "trainer", "operator")
DIR_MODE = 0o700
FILE_MODE = 0o600


class CredsError(RuntimeError):
    pass


def inbox_prefix(user: str) -> str:
    """The reply-inbox prefix of a client logged in as ``user`` (``_INBOX`` when anonymous)."""
    return f"_INBOX_{user}" if user else "_INBOX"


def _private_dir(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    os.chmod(d, DIR_MODE)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a 0600 file through a temporary name (never world-readable)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, path)


def ensure(creds_dir: Path) -> dict[str, tuple[str, str]]:
    """Every role's ``(user, password)``, generating the missing ones (first start)."""
    try:
        _private_dir(creds_dir)
    except OSError as e:  # a bad setting: say which one (README "Settings")
        raise CredsError(
            f"ROLLBUS_NATS_CREDS_DIR={creds_dir}: cannot create it ({e.strerror or e})"
        ) from None
    for role in ROLES:
        path = creds_dir / role
        if not path.exists():
            # a letter first: nats-server parses a `$VAR` value that starts with `-` or a
            # digit as a number, so such a password would break an external auth.conf
            _write_private(path, f"{role}:p{secrets.token_urlsafe(32)}\n")
        else:
            os.chmod(path, FILE_MODE)
    return {role: load(creds_dir, role) for role in ROLES}


def load(creds_dir: Path, role: str) -> tuple[str, str]:
    """``(user, password)`` of ``role`` from ``creds_dir``; :class:`CredsError` if absent."""
    if role not in ROLES:
        raise CredsError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    path = creds_dir / role
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise CredsError(
            f"no {role} credentials in {creds_dir}: start `rollbus serve` once (it generates "
            f"them), or write '{role}:PASSWORD' there for an external server"
        ) from None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise CredsError(f"{path}: expected one line 'user:password'")
    return user, password


def find(creds_dir: Path, role: str) -> tuple[str, str] | None:
    """Like :func:`load`, but ``None`` when that role has no file (no auth configured)."""
    if not (creds_dir / role).exists():
        return None
    return load(creds_dir, role)


def url_user(url: str) -> str:
    """The user name carried by the first URL of a comma-separated list ("" if none)."""
    first = url.split(",")[0].strip()
    return unquote(urlsplit(first).username or "") if "://" in first else ""


def has_userinfo(url: str) -> bool:
    return any("@" in urlsplit(u.strip()).netloc for u in url.split(",") if "://" in u)


def with_creds(url: str, user: str, password: str) -> str:
    """``url`` (a comma-separated list) with ``user:password@`` in every server URL."""
    out = []
    for u in (x.strip() for x in url.split(",") if x.strip()):
        parts = urlsplit(u if "://" in u else f"nats://{u}")
        host = parts.netloc.rsplit("@", 1)[-1]
        auth = f"{quote(user, safe='')}:{quote(password, safe='')}@"
        out.append(urlunsplit(parts._replace(netloc=auth + host)))
    return ",".join(out)


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (what may be logged or returned)."""
    out = []
    for u in (x.strip() for x in url.split(",") if x.strip()):
        parts = urlsplit(u)
        if "@" not in parts.netloc:
            out.append(u)
            continue
        auth, host = parts.netloc.rsplit("@", 1)
        user = auth.split(":", 1)[0]
        out.append(urlunsplit(parts._replace(netloc=f"{user}:***@{host}")))
    return ",".join(out)


def public(url: str) -> str:
    """``url`` without any credentials (what a status route may show)."""
    out = []
    for u in (x.strip() for x in url.split(",") if x.strip()):
        parts = urlsplit(u)
        out.append(urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])))
    return ",".join(out)


def role_url(url: str, role: str, creds_dir: Path) -> str:
    """``url`` carrying ``role``'s credentials when ``creds_dir`` has them.

    A URL that already carries credentials is kept as is; with no file for the role (an
    external server without auth) the URL is returned unchanged."""
    if has_userinfo(url):
        return url
    found = find(creds_dir, role)
    return with_creds(url, *found) if found else url


def local_server_url(s: Settings) -> str:
    """The URL of the embedded server of a stack started with the same settings: the port
    it really listens on when it runs (its ports file), else ``NATS_PORT``."""
    scheme = "tls" if s.nats_tls_cert else "nats"
    for f in sorted((s.data_dir / "nats" / "ports").glob("*.ports")):
        try:
            pid = int(f.stem.rsplit("_", 1)[1])
            os.kill(pid, 0)
            port = int(json.loads(f.read_text())["nats"][0].rsplit(":", 1)[1])
        except (ValueError, IndexError, KeyError, OSError):
            continue
        return f"{scheme}://127.0.0.1:{port}"
    return f"{scheme}://127.0.0.1:{s.nats_port}"


def default_dir() -> Path:
    """The credentials directory from the environment, as :class:`Settings` resolves it
    (``ROLLBUS_NATS_CREDS_DIR``, else ``ROLLBUS_DATA_DIR/creds``, else ``.data/creds``):
    what the trainer SDK looks in when run beside the stack."""
    env = os.environ
    explicit = env.get("ROLLBUS_NATS_CREDS_DIR", "").strip()
    return Path(explicit) if explicit else Path(env.get("ROLLBUS_DATA_DIR") or ".data") / "creds"


def client_tls(ca: str = "", cert: str = "", key: str = "") -> ssl.SSLContext | None:
    """The client's TLS context: verify the server with ``ca`` (else the system CAs) and
    present ``cert``/``key`` when given (servers that verify clients). ``None`` when
    nothing is configured."""
    if not (ca or cert):
        return None
    # a missing or bad file is a bad setting: name it (ssl.SSLError is an OSError)
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
    except OSError as e:
        raise CredsError(f"ROLLBUS_NATS_TLS_CA={ca}: {e.strerror or e}") from None
    if cert:
        try:
            ctx.load_cert_chain(cert, key or None)
        except OSError as e:
            raise CredsError(
                f"ROLLBUS_NATS_TLS_CLIENT_CERT={cert} / ROLLBUS_NATS_TLS_CLIENT_KEY={key}: "
                f"{e.strerror or e}"
            ) from None
    return ctx


def client_tls_from_env() -> ssl.SSLContext | None:
    """:func:`client_tls` from ``ROLLBUS_NATS_TLS_CA`` / ``_CLIENT_CERT`` / ``_CLIENT_KEY``
    (the settings every process shares)."""
    env = os.environ
    return client_tls(
        env.get("ROLLBUS_NATS_TLS_CA", "").strip(),
        env.get("ROLLBUS_NATS_TLS_CLIENT_CERT", "").strip(),
        env.get("ROLLBUS_NATS_TLS_CLIENT_KEY", "").strip(),
    )
