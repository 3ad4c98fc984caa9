"""``rollbus publish`` argument errors: one line on stderr, exit 2, before any bus."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main
from services.tiny_model import create_model_dir


@pytest.mark.parametrize("tp", ["0", "-1"])
def test_publish_tp_below_one_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tp: str
) -> None:
    """``--tp 0`` fell back to ROLLBUS_TP (``args.tp or settings.tp``) and published for
    another tp than asked; the URL is unreachable, so reaching the bus fails differently."""
    d = create_model_dir(tmp_path / "m")
    argv = ["publish", str(d), "--model", "m", "--version", "v1", "--tp", tp]
    rc = main([*argv, "--nats-url", "nats://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"tp must be >= 1, got {tp}" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("model", ["", ".", "..", "a\nb"])
def test_publish_bad_model_name_is_refused_before_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    """The model id is a path component of ``<ipc_dir>/<model>/<version>/`` (percent-quoted,
    which leaves ``..`` alone): ``--model ..`` wrote the version beside the ipc dir, and
    ``--model ''`` uploaded every shard before failing on the empty subject token. The URL
    is unreachable: refusing the name must not need the bus."""
    d = create_model_dir(tmp_path / "m")
    ipc = tmp_path / "shm" / "ipc"
    argv = ["publish", str(d), "--model", model, "--version", "v1", "--tp", "1", "--ipc"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLLBUS_IPC_DIR", str(ipc))
        rc = main([*argv, "--nats-url", "nats://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "bad model name" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "shm").exists()


@pytest.mark.parametrize("cmd", ["versions", "publish", "fleet"])
def test_missing_tls_ca_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    d = create_model_dir(tmp_path / "m")
    args = {
        "publish": ["publish", str(d), "--version", "v1", "--tp", "1", "--model", "m"],
        "versions": ["versions", "--model", "m"],
        "fleet": ["fleet", "status"],
    }[cmd]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLLBUS_NATS_TLS_CA", str(tmp_path / "no-ca.pem"))
        rc = main([*args, "--nats-url", "tls://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "ROLLBUS_NATS_TLS_CA" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("model", ["", "\x00"])
def test_versions_bad_model_name_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], model: str
) -> None:
    """``rollbus versions --model ''`` was a ValueError traceback (empty subject token)."""
    rc = main(["versions", "--model", model, "--nats-url", "nats://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "bad model name" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_publish_a_file_instead_of_a_dir_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file path (``model.safetensors`` given for its dir) said ``no such directory``
    about a path that exists."""
    f = create_model_dir(tmp_path / "m") / "config.json"
    rc = main(["publish", str(f), "--model", "m", "--version", "v1", "--tp", "1",
               "--nats-url", "nats://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"not a directory: {f}" in err and "no such" not in err, err
    assert len(err.strip().splitlines()) == 1, err
