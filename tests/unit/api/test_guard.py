"""The cross-site check and the token comparison of the API, as pure functions."""

from __future__ import annotations

import hmac
import json
from typing import Any

import pytest
from starlette.requests import Request

from services.api.control import client_request_id
from services.api.deps import bearer_ok
from services.api.guard import CrossSiteGuard, changes_state, cross_site_reason, same_origin

HOST = {"host": "127.0.0.1:8000"}


@pytest.mark.parametrize(
    "method, path, state",
    [
        ("POST", "/v1/pause", True),
        ("POST", "/v1/completions", True),
        ("DELETE", "/anything", True),
        ("GET", "/clear_load_weight", True),
        ("GET", "/update_model_weight", True),
        ("GET", "/v1/status", False),
        ("GET", "/v1/models", False),
        ("HEAD", "/health", False),
    ],
)
def test_state_changing_routes(method: str, path: str, state: bool) -> None:
    assert changes_state(method, path) is state


@pytest.mark.parametrize("site", ["cross-site", "same-site", "Cross-Site"])
def test_sec_fetch_site_cross_or_same_site_is_refused(site: str) -> None:
    why = cross_site_reason("POST", "/v1/pause", {**HOST, "sec-fetch-site": site})
    assert why is not None and "Sec-Fetch-Site" in why and "/v1/pause" in why
    why = cross_site_reason("GET", "/clear_load_weight", {**HOST, "sec-fetch-site": site})
    assert why is not None


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "http://127.0.0.1:3000",  # another port on this host is another origin
        "https://127.0.0.1:8000",  # another scheme
        "http://localhost:8000",  # not the Host this request was sent to
        "null",
        "http://127.0.0.1:8000.evil.example",
        "http://user@127.0.0.1:8000",
    ],
)
def test_foreign_origin_is_refused(origin: str) -> None:
    why = cross_site_reason("POST", "/v1/sleep", {**HOST, "origin": origin})
    assert why is not None and "Origin" in why


@pytest.mark.parametrize(
    "headers",
    [
        {},  # curl, httpx, the OpenAI SDK, the trainer: neither header
        {"sec-fetch-site": "same-origin", "origin": "http://127.0.0.1:8000"},
        {"sec-fetch-site": "none"},  # typed into the address bar
        {"origin": "http://127.0.0.1:8000/"},
    ],
)
def test_same_origin_and_non_browser_requests_pass(headers: dict[str, str]) -> None:
    assert cross_site_reason("POST", "/v1/pause", {**HOST, **headers}) is None


def test_reads_are_not_guarded() -> None:
    h = {**HOST, "sec-fetch-site": "cross-site", "origin": "http://evil.example"}
    assert cross_site_reason("GET", "/v1/status", h) is None


def test_allowed_origins_pass() -> None:
    h = {**HOST, "sec-fetch-site": "cross-site", "origin": "http://ui.example:3000"}
    ok = ["http://ui.example:3000"]
    assert cross_site_reason("POST", "/v1/pause", h, allowed_origins=ok) is None
    assert cross_site_reason("POST", "/v1/pause", h, allowed_origins=["http://ui.example"])


def test_default_ports() -> None:
    assert same_origin("http://example.com", "example.com:80")
    assert same_origin("https://example.com", "example.com", "https")
    assert not same_origin("http://example.com", "example.com:8080")


def test_bearer_ok_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bearer_ok("Bearer s3cret", "s3cret")
    for bad in ("", "Bearer", "Bearer s3cre", "Bearer s3cretx", "Basic s3cret", "s3cret"):
        assert not bearer_ok(bad, "s3cret")
    calls = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert bearer_ok("Bearer s3cret", "s3cret") and calls  # hmac.compare_digest decides


def test_dns_rebinding_host_is_refused_on_a_loopback_server() -> None:
    rebound = {"host": "evil.example:8000", "origin": "http://evil.example:8000",
               "sec-fetch-site": "same-origin"}
    assert cross_site_reason("POST", "/v1/pause", rebound) is None  # same origin, literally
    why = cross_site_reason("POST", "/v1/pause", rebound, loopback_only=True)
    assert why is not None and "DNS rebinding" in why
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000"):
        h = {"host": host, "sec-fetch-site": "same-origin"}
        assert cross_site_reason("POST", "/v1/pause", h, loopback_only=True) is None
    # non-browser clients may use any name (no Origin, no Sec-Fetch-Site)
    assert cross_site_reason("POST", "/v1/pause", {"host": "rollbus:8000"},
                             loopback_only=True) is None


async def _refused(path: str, rid: bytes | None) -> tuple[int, dict[bytes, bytes], dict[str, Any]]:
    """A cross-site POST to ``path`` through the middleware: status, headers, JSON body."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise AssertionError("a cross-site request reached the app")

    guard = CrossSiteGuard(app, control_paths=["/v1/pause"])
    headers = [(b"host", b"127.0.0.1:8000"), (b"sec-fetch-site", b"cross-site")]
    headers += [(b"x-request-id", rid)] if rid is not None else []
    scope = {"type": "http", "method": "POST", "path": path, "scheme": "http",
             "headers": headers, "query_string": b""}
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await guard(scope, None, send)
    start, body = sent
    return start["status"], dict(start["headers"]), json.loads(body["body"])


@pytest.mark.parametrize(
    "raw, rid",
    [
        ("ünï-1".encode(), "ünï-1"),  # UTF-8 bytes: read back as sent, not as mojibake
        ("ü-2".encode("latin-1"), "ü-2"),  # latin-1 text (what `requests` sends)
        (b"plain-3", "plain-3"),
    ],
    ids=["utf8", "latin1", "ascii"],
)
async def test_a_refused_control_call_names_the_id_other_replies_give(raw: bytes, rid: str) -> None:
    """The 403's ``request_id`` is what every other control reply gives for this
    ``X-Request-Id`` (:func:`client_request_id`), and the header is echoed byte for byte."""
    status, headers, body = await _refused("/v1/pause", raw)
    assert status == 403 and body["error_code"] == 403
    assert body["request_id"] == rid
    scope = {"type": "http", "headers": [(b"x-request-id", raw)]}
    assert body["request_id"] == client_request_id(Request(scope))
    assert headers[b"x-request-id"] == raw
    status, headers, body = await _refused("/v1/completions", raw)
    assert status == 403 and headers[b"x-request-id"] == raw
    status, _, body = await _refused("/v1/pause", None)  # no id sent: a new one
    assert len(body["request_id"]) == 32
