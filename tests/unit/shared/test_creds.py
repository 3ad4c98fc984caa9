"""Credentials files, URLs carrying them, redaction; infra/nats/auth.conf is current."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services import natsd
from shared import creds
from shared.settings import Settings


def test_generated_once_private_and_stable(tmp_path: Path) -> None:
    d = tmp_path / "creds"
    first = creds.ensure(d)
    assert set(first) == set(creds.ROLES)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for role, (user, password) in first.items():
        assert user == role and len(password) >= 40
        assert stat.S_IMODE((d / role).stat().st_mode) == 0o600
    assert len({p for _, p in first.values()}) == len(creds.ROLES)
    (d / "api").chmod(0o644)  # loosened by hand: tightened again at the next start
    assert creds.ensure(d) == first
    assert stat.S_IMODE((d / "api").stat().st_mode) == 0o600


def test_missing_unknown_and_malformed(tmp_path: Path) -> None:
    with pytest.raises(creds.CredsError, match="start `rollbus serve` once"):
        creds.load(tmp_path, "engine")
    with pytest.raises(creds.CredsError, match="unknown role"):
        creds.load(tmp_path, "root")
    (tmp_path / "api").write_text("nocolon\n")
    with pytest.raises(creds.CredsError, match="user:password"):
        creds.load(tmp_path, "api")
    assert creds.find(tmp_path, "engine") is None


def test_urls_carry_and_hide_credentials(tmp_path: Path) -> None:
    url = creds.with_creds("nats://h1:4222, tls://h2:4223", "api", "p/w@x")
    assert url == "nats://api:p%2Fw%40x@h1:4222,tls://api:p%2Fw%40x@h2:4223"
    assert creds.url_user(url) == "api" and creds.has_userinfo(url)
    assert creds.redact(url) == "nats://api:***@h1:4222,tls://api:***@h2:4223"
    assert creds.redact("nats://h:1") == "nats://h:1"
    assert creds.public(url) == "nats://h1:4222,tls://h2:4223"
    assert creds.inbox_prefix("api") == "_INBOX_api" and creds.inbox_prefix("") == "_INBOX"
    # role_url: adds the role's creds when the dir has them, keeps explicit ones
    assert creds.role_url("nats://h:1", "worker", tmp_path) == "nats://h:1"
    creds.ensure(tmp_path)
    assert creds.url_user(creds.role_url("nats://h:1", "worker", tmp_path)) == "worker"
    assert creds.role_url("nats://me:pw@h:1", "worker", tmp_path) == "nats://me:pw@h:1"


def test_creds_dir_setting(tmp_path: Path) -> None:
    assert Settings(data_dir=tmp_path).creds_dir == tmp_path / "creds"
    assert Settings(nats_creds_dir=str(tmp_path / "x")).creds_dir == tmp_path / "x"


def test_infra_auth_conf_is_the_generated_one() -> None:
    """infra/nats/auth.conf has exactly the embedded server's permissions
    (regenerate: `python -m services.natsd auth-conf > infra/nats/auth.conf`)."""
    path = Path(__file__).resolve().parents[3] / "infra" / "nats" / "auth.conf"
    assert path.read_text() == natsd.auth_conf()


def test_generated_server_config_never_has_world_access(tmp_path: Path) -> None:
    text = natsd.server_config(creds.ensure(tmp_path / "c"))
    for role in creds.ROLES:
        assert f'"user": "{role}"' in text
    perms = natsd.permissions()
    for p in perms.values():
        assert ">" not in p["publish"] and ">" not in p["subscribe"]
        assert "$JS.API.>" not in p["publish"]
        assert not any("STREAM.DELETE" in s for s in p["publish"])


def test_tls_cert_and_key_go_together() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="go together"):
        Settings(nats_tls_cert="server.pem")
    with pytest.raises(ValidationError, match="go together"):
        Settings(nats_tls_key="server.key")
    assert Settings(nats_tls_cert="a", nats_tls_key="b").nats_tls_cert == "a"


def test_rollbus_creds_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    assert main(["creds", "operator", "--data-dir", str(tmp_path)]) == 2
    assert "start `rollbus serve` once" in capsys.readouterr().err
    users = creds.ensure(tmp_path / "creds")
    assert main(["creds", "operator", "--data-dir", str(tmp_path), "--nats-port", "4333"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"nats://operator:{users['operator'][1]}@127.0.0.1:4333"
    assert main(["creds", "nobody", "--data-dir", str(tmp_path)]) == 2


def test_trainer_finds_its_credentials_beside_the_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from services.trainer.cli import nats_url_of

    users = creds.ensure(tmp_path / "creds")
    monkeypatch.setenv("ROLLBUS_DATA_DIR", str(tmp_path))
    assert creds.default_dir() == tmp_path / "creds"
    s = Settings(data_dir=tmp_path, nats_port=4333)
    url = nats_url_of(argparse.Namespace(nats_url=None), s)
    assert url == creds.with_creds("nats://127.0.0.1:4333", *users["trainer"])
    # credentials given explicitly win
    given = "nats://me:pw@h:1"
    assert nats_url_of(argparse.Namespace(nats_url=given), s) == given


async def test_rollbus_creds_of_several_servers_is_one_url_nats_py_connects_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nats_url: str
) -> None:
    """`NATS_URL` a comma-separated list (a cluster): nats-py refuses a comma-separated
    string, so `rollbus creds` prints one server, the first that answers (a node that is
    down is skipped); `--all` prints the list for the nats CLI."""
    import nats

    from services.cli import main
    from services.serveproc import free_port

    users = creds.ensure(tmp_path / "creds")
    down = f"nats://127.0.0.1:{free_port()}"
    urls = f"{down},{nats_url}"
    argv = ["creds", "operator", "--data-dir", str(tmp_path), "--nats-url", urls]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert out == creds.with_creds(nats_url, *users["operator"])
    nc = await nats.connect(out, allow_reconnect=False, connect_timeout=5)
    await nc.close()
    assert main([*argv, "--all"]) == 0
    assert capsys.readouterr().out.strip() == creds.with_creds(urls, *users["operator"])


def test_creds_dir_not_creatable_names_the_setting(tmp_path: Path) -> None:
    """Was ``rollbus: [Errno 2] No such file or directory: '/proc/x'`` from serve: no
    word of which setting to fix."""
    (tmp_path / "file").write_text("")
    with pytest.raises(creds.CredsError) as e:
        creds.ensure(tmp_path / "file" / "creds")
    assert "ROLLBUS_NATS_CREDS_DIR" in str(e.value) and "file/creds" in str(e.value)


@pytest.mark.parametrize(
    "kw, var",
    [
        ({"ca": "/nonexistent/ca.pem"}, "ROLLBUS_NATS_TLS_CA"),
        ({"cert": "/nonexistent/c.pem"}, "ROLLBUS_NATS_TLS_CLIENT_CERT"),
    ],
)
def test_missing_tls_file_names_the_setting(kw: dict[str, str], var: str) -> None:
    """Was a bare FileNotFoundError traceback from `rollbus serve` / `publish` / `versions`."""
    with pytest.raises(creds.CredsError) as e:
        creds.client_tls(**kw)
    assert var in str(e.value) and "/nonexistent/" in str(e.value), str(e.value)
