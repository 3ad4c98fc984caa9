"""Control arguments from the query or a JSON body (the query wins), and the Bearer
scheme in any case."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from services.api.app import create_app
from services.api.deps import bearer_ok
from shared.settings import Settings


@pytest.fixture(autouse=True)
def _model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 128}')
    monkeypatch.setenv("ROLLBUS_MODEL", str(tmp_path))
    monkeypatch.setenv("ROLLBUS_DATA_DIR", str(tmp_path / "data"))


def client(**kw: Any) -> TestClient:
    return TestClient(create_app(Settings(**kw)))


@pytest.mark.parametrize(
    "path, query, body, want",
    [
        ("/v1/pause", "", {"mode": "keep"}, {"mode": "keep"}),
        ("/v1/pause", "?mode=wait", {"mode": "keep"}, {"mode": "wait"}),  # query wins
        ("/v1/pause", "", None, {}),
        ("/v1/sleep", "", {"tags": "weight"}, {"tags": "weight"}),
        ("/v1/sleep", "", {"tags": ["weight", "kv_cache"]}, {"tags": "weight,kv_cache"}),
        ("/v1/sleep", "?tags=kv_cache", {"tags": "weight"}, {"tags": "kv_cache"}),
        ("/v1/wakeup", "", {"tags": "weight"}, {"tags": "weight"}),
        # the call's own argument null or "" is absent: its default (README)
        ("/v1/pause", "", {"mode": None}, {}),
        ("/v1/pause", "", {"mode": ""}, {}),
        ("/v1/sleep", "", {"tags": None}, {}),
        ("/v1/wakeup", "", {"tags": ""}, {}),
        ("/v1/resume", "", {}, {}),
    ],
)
def test_args_from_query_or_body(
    calls: list[tuple[str, dict[str, Any]]], path: str, query: str, body: Any, want: Any
) -> None:
    c = client()
    r = c.post(path + query, json=body) if body is not None else c.post(path + query)
    assert r.status_code == 200, r.text
    assert calls == [(path.rsplit("/", 1)[-1], want)]


def test_bad_body_arg_is_400(calls: list[tuple[str, dict[str, Any]]]) -> None:
    r = client().post("/v1/pause", json={"mode": "nap"})
    assert r.status_code == 400 and calls == []
    r = client().post("/v1/sleep", content=b"[1]")
    assert r.status_code == 400 and calls == []


def test_bearer_scheme_is_case_insensitive(calls: list[tuple[str, dict[str, Any]]]) -> None:
    assert bearer_ok("bearer sekret", "sekret") and bearer_ok("BEARER sekret", "sekret")
    assert not bearer_ok("Basic sekret", "sekret") and not bearer_ok("bearer sekre", "sekret")
    assert not bearer_ok("bearer", "sekret") and not bearer_ok("sekret", "sekret")
    c = client(admin_token="sekret")
    assert c.post("/v1/pause", headers={"authorization": "bearer sekret"}).status_code == 200
    assert c.post("/v1/pause", headers={"authorization": "bearer nope"}).status_code == 401
    # 401 before the body is read
    r = c.post("/v1/pause", content=b"{not json", headers={"authorization": "bearer x"})
    assert r.status_code == 401


@pytest.mark.parametrize(
    "path, content, param",
    [
        ("/v1/pause", b'{"bogus": 1}', "bogus"),  # an unknown field is named, not ignored
        ("/v1/pause", b'{"mod": null}', "mod"),  # ... even null or "": never a default abort
        ("/v1/pause", b'{"mod": ""}', "mod"),
        ("/v1/resume", b'{"x": null}', "x"),
        ("/v1/resume", b'{"": null}', "body"),  # resume has no argument: "" names none
        ("/v1/sleep", b'{"tag": null}', "tag"),
        ("/v1/wakeup", b'{"tag": ""}', "tag"),
        ("/v1/pause", b'{"mode": "bogus"}', "mode"),
        ("/v1/pause", b"{bad", "body"),
        ("/v1/resume", b"{bad", "body"),
        ("/v1/resume", b'{"x": "\xff"}', "body"),
        ("/v1/sleep", b'{"tags": 5}', "tags"),
        ("/v1/resume", b'{"mode": "keep"}', "mode"),  # resume takes no argument
        # a version is a path component: refused here, before the engine or a rank
        ("/v1/update_weights", b'{"version": "../x"}', "version"),
        ("/v1/update_weights", b'{"version": ".."}', "version"),
        ("/v1/update_weights", b'{"version": "a\\u0000b"}', "version"),
        ("/v1/update_weights", b'{"version": "v1\\n"}', "version"),
    ],
)
def test_bad_control_bodies_are_400_naming_the_field(
    calls: list[tuple[str, dict[str, Any]]], path: str, content: bytes, param: str
) -> None:
    r = client().post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["result"]["param"] == param, r.text
    assert calls == []


def test_a_control_body_over_the_limit_is_400(calls: list[tuple[str, dict[str, Any]]]) -> None:
    r = client(max_body_bytes=1024).post("/v1/resume", content=b"{" + b" " * 4096 + b"}")
    assert r.status_code == 400 and r.json()["result"]["param"] == "body", r.text
    assert calls == []


@pytest.mark.parametrize(
    "query, want",
    [
        ("", {}),
        ("?fresh=true", {"fresh": True}),
        ("?fresh=TRUE", {"fresh": True}),
        ("?fresh=1", {"fresh": True}),
        ("?fresh=false", {}),
        ("?fresh=0", {}),
        ("?fresh=", {}),
    ],
)
def test_status_fresh_param(calls: list[tuple[str, dict[str, Any]]], query: str, want: Any) -> None:
    r = client().get("/v1/status" + query)
    assert r.status_code == 200, r.text
    assert calls == [("status", want)]


@pytest.mark.parametrize("value", ["yes", "2", "truee"])
def test_status_fresh_param_not_a_bool_is_400_naming_it(
    calls: list[tuple[str, dict[str, Any]]], value: str
) -> None:
    r = client().get(f"/v1/status?fresh={value}")
    assert r.status_code == 400, r.text
    assert r.json()["result"] == {"param": "fresh"} and "'fresh'" in r.json()["error_message"]
    assert calls == []
    # the token comes first
    r = client(admin_token="s3cret").get(f"/v1/status?fresh={value}")
    assert r.status_code == 401, r.text


@pytest.mark.parametrize(
    "query", ["?fresh=junk&fresh=true", "?fresh=true&fresh=junk", "?fresh=true&fresh=true"]
)
def test_status_fresh_param_repeated_is_400_naming_it(
    calls: list[tuple[str, dict[str, Any]]], query: str
) -> None:
    r = client().get("/v1/status" + query)
    assert r.status_code == 400, r.text
    assert r.json()["result"] == {"param": "fresh"} and "'fresh'" in r.json()["error_message"]
    assert calls == []


@pytest.mark.parametrize(
    "sent, want",
    [
        ("ünï©ødé".encode(), "ünï©ødé"),  # UTF-8 bytes, as curl or a browser send them
        ("ü".encode("latin-1"), "ü"),  # latin-1, as `requests` sends it
        (b"a.b *>", "a.b *>"),
    ],
)
def test_a_control_reply_names_the_client_id_as_sent(sent: bytes, want: str) -> None:
    from starlette.requests import Request

    from services.api.control import client_request_id

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/pause",
        "query_string": b"",
        "headers": [(b"x-request-id", sent)],
    }
    assert client_request_id(Request(scope)) == want


@pytest.mark.parametrize(
    "query, body, want",
    [
        ("?version=v1", None, {"version": "v1"}),
        ("?version=v1&verify_checksum=true", None, {"version": "v1", "verify_checksum": True}),
        ("?verify_checksum=0", None, {"verify_checksum": False}),
        ("?version=v2", {"version": "v1"}, {"version": "v2"}),  # the query wins
        ("", {"version": "v1"}, {"version": "v1"}),
    ],
)
def test_update_weights_takes_its_arguments_from_the_query_too(
    calls: list[tuple[str, dict[str, Any]]], query: str, body: Any, want: dict[str, Any]
) -> None:
    """``update_weights?version=v1`` updates to v1 (it read only the body: the query was
    dropped and the call went on to version.txt's version, silently)."""
    c = client()
    path = "/v1/update_weights" + query
    r = c.post(path, json=body) if body is not None else c.post(path)
    assert r.status_code == 200, r.text
    assert calls == [("update_weights", want)]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/pause?mod=keep",  # a typo must not abort every request (the default mode)
        "/v1/pause?mode=keep&x=1",
        "/v1/resume?mode=keep",
        "/v1/sleep?tag=weight",
        "/v1/wakeup?tag=weight",
        "/v1/update_weights?versions=v1",
        "/v1/update_weights?verify_checksum=maybe",
    ],
)
def test_an_unknown_or_bad_query_parameter_of_a_mutating_call_is_400(
    calls: list[tuple[str, dict[str, Any]]], path: str
) -> None:
    r = client().post(path)
    assert r.status_code == 400, r.text
    assert r.json()["result"]["param"] in ("mod", "x", "mode", "tag", "versions", "verify_checksum")
    assert calls == []


def test_legacy_gets_refuse_unknown_query_parameters(
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    assert client().get("/clear_load_weight?tags=kv_cache").status_code == 400
    assert client().get("/clear_load_weight").status_code == 200
    assert calls == [("sleep", {})]
