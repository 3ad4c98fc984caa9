"""Refuse cross-site browser requests on every route that changes state.

A web page in a browser on the operator's host can make the browser send requests to
``127.0.0.1:8000`` (a form post, an ``<img src=/clear_load_weight>``). The browser
then says where the request comes from: ``Sec-Fetch-Site`` (``same-origin``,
``same-site``, ``cross-site``, ``none`` = typed by the user) and, on POSTs and
cross-origin fetches, ``Origin``. Non-browser clients (curl, httpx, the OpenAI SDK,
the trainer) send neither and are not affected.

Guarded: every method other than GET/HEAD/OPTIONS, and the legacy GETs that change
state (``/clear_load_weight``, ``/update_model_weight``). Refused with 403 and the
reason: ``Sec-Fetch-Site`` ``cross-site`` or ``same-site`` (another port or subdomain of
this host is another site's page as far as we are concerned), or an ``Origin`` whose
``scheme://host:port`` is not this server's own (the request's ``Host``), ``null``
included. Origins listed in ``ROLLBUS_ALLOWED_ORIGINS`` are let through.

DNS rebinding (a page whose own name resolves to 127.0.0.1, so it looks same-origin):
when the API listens on loopback only, a browser request (one that carries ``Origin`` or
``Sec-Fetch-Site``) whose ``Host`` is not ``localhost`` or an IP address is refused too.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request

from services.api.control import client_request_id
from shared.errors import FORBIDDEN

STATE_CHANGING_GETS = frozenset({"/clear_load_weight", "/update_model_weight"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443}

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def changes_state(method: str, path: str) -> bool:
    return method.upper() not in SAFE_METHODS or path in STATE_CHANGING_GETS


def _origin_key(scheme: str, hostport: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host[:port]`` with the scheme's default port; None if bad."""
    try:
        u = urlsplit(f"{scheme}://{hostport}")
        port = u.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        return None
    if not u.hostname or port is None:
        return None
    return u.hostname.lower(), port


def same_origin(origin: str, host: str, scheme: str = "http") -> bool:
    """``origin`` (``scheme://host[:port]``) names the server reached at ``host``."""
    try:
        u = urlsplit(origin)
    except ValueError:
        return False
    if u.scheme not in _DEFAULT_PORTS or u.path not in ("", "/") or u.username or u.query:
        return False
    if u.scheme != scheme:
        return False
    mine, theirs = _origin_key(scheme, host), _origin_key(u.scheme, u.netloc)
    return mine is not None and mine == theirs


def is_loopback_or_ip(host: str) -> bool:
    """``host`` (``name[:port]``) is ``localhost`` / ``*.localhost`` or an IP literal."""
    key = _origin_key("http", host)
    if key is None:
        return False
    name = key[0].strip("[]")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def cross_site_reason(
    method: str,
    path: str,
    headers: Mapping[str, str],
    scheme: str = "http",
    allowed_origins: Iterable[str] = (),
    loopback_only: bool = False,
) -> str | None:
    """Why this request must be refused (403), or None. ``headers`` keys lower-case.
    ``loopback_only``: the server listens on a loopback address only."""
    if not changes_state(method, path):
        return None
    origin = headers.get("origin", "").strip()
    browser = bool(origin or headers.get("sec-fetch-site"))
    host = headers.get("host", "")
    if loopback_only and browser and not is_loopback_or_ip(host):
        return (
            f"cross-site request refused: Host {host[:100]!r} is not a loopback name or an "
            f"IP address on a loopback-only server (DNS rebinding?) ({method} {path})"
        )
    allowed = {o.strip().rstrip("/").lower() for o in allowed_origins if o.strip()}
    if origin and origin.rstrip("/").lower() in allowed:
        return None
    site = headers.get("sec-fetch-site", "").strip().lower()
    if site in ("cross-site", "same-site"):
        return (
            f"cross-site request refused: Sec-Fetch-Site: {site} on a state-changing route "
            f"({method} {path}); only same-origin and non-browser requests may change state"
        )
    if origin:
        if origin == "null" or not same_origin(origin, host, scheme):
            return (
                f"cross-site request refused: Origin {origin[:100]!r} is not this server "
                f"(Host {host[:100]!r}) on a state-changing route ({method} {path})"
            )
    return None


class CrossSiteGuard:
    """ASGI middleware applying :func:`cross_site_reason`; control routes answer with
    the control reply shape, the others with the OpenAI error shape."""

    def __init__(
        self,
        app: ASGIApp,
        control_paths: Iterable[str],
        allowed_origins: Iterable[str] = (),
        loopback_only: bool = False,
    ) -> None:
        self.app = app
        self.control_paths = frozenset(control_paths)
        self.allowed_origins = tuple(allowed_origins)
        self.loopback_only = loopback_only

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not changes_state(
            scope.get("method", "GET"), scope.get("path", "")
        ):
            await self.app(scope, receive, send)  # nothing to check: no header decoding
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope.get("path", "")
        reason = cross_site_reason(
            scope.get("method", "GET"),
            path,
            headers,
            scope.get("scheme", "http"),
            self.allowed_origins,
            self.loopback_only,
        )
        if reason is None:
            await self.app(scope, receive, send)
            return
        body: dict[str, Any]
        if path in self.control_paths:
            # the id every other control reply gives (an UTF-8 id read back as sent)
            rid = client_request_id(Request(scope))
            body = {"request_id": rid, "error_code": FORBIDDEN, "error_message": reason,
                    "result": None}
        else:
            body = {"error": {"message": reason, "type": "permission_error", "param": None,
                              "code": FORBIDDEN}}
        data = json.dumps(body).encode()
        out = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        # echoed byte for byte, as on every other response
        out += [(k, v) for k, v in scope["headers"] if k.lower() == b"x-request-id"][:1]
        await send({"type": "http.response.start", "status": FORBIDDEN, "headers": out})
        await send({"type": "http.response.body", "body": data})
