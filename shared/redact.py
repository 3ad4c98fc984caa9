"""What may be shown about a URL or a path in a response or a log line. Pure.

No route returns credentials or absolute filesystem paths: a NATS URL is shown as
``scheme://host:port`` (user, password, token, path and query dropped), a file as its
path relative to a named root.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit


def public_url(url: str) -> str:
    """``nats://user:pass@host:4222/x?y`` -> ``nats://host:4222``; each of a
    comma-separated list the same way; anything unparsable -> ``<redacted>``."""
    out = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            u = urlsplit(part if "://" in part else f"nats://{part}")
            host, port = u.hostname, u.port
        except ValueError:
            out.append("<redacted>")
            continue
        if not host:
            out.append("<redacted>")
            continue
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        out.append(f"{u.scheme}://{host}" + (f":{port}" if port else ""))
    return ",".join(out)


def public_path(path: Path | str, root: Path | str, label: str = "") -> str:
    """``path`` relative to ``root`` (prefixed ``label``), or only its file name when it
    lies outside ``root``: never the absolute path."""
    p, r = Path(path), Path(root)
    try:
        rel = p.relative_to(r).as_posix()
    except ValueError:
        try:
            rel = p.resolve().relative_to(r.resolve()).as_posix()
        except (ValueError, OSError):
            rel = p.name
    return f"{label}{rel}" if label else rel
