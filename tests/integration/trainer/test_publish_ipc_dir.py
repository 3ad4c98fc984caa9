"""``rollbus publish --ipc`` into an IPC_DIR it refuses or cannot create: one line naming
ROLLBUS_IPC_DIR, exit 2 (a real nats-server: the ipc write comes after the connect)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main
from services.tiny_model import create_model_dir


@pytest.mark.parametrize("kind", ["world-writable", "not creatable"])
def test_bad_ipc_dir_is_one_clear_line(
    tmp_path: Path, nats_url: str, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Was an UnsafeIpcDir traceback (exit 1), or a bare ``[Errno 20] ...`` line."""
    d = create_model_dir(tmp_path / "m")
    if kind == "world-writable":
        ipc = tmp_path / "ipc"
        ipc.mkdir()
        ipc.chmod(0o777)
    else:
        (tmp_path / "file").write_text("")
        ipc = tmp_path / "file" / "ipc"
    argv = ["publish", str(d), "--model", "m", "--version", "v1", "--tp", "1", "--ipc"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLLBUS_IPC_DIR", str(ipc))
        rc = main([*argv, "--nats-url", nats_url])
    err = capsys.readouterr().err
    assert rc == 2 and f"ROLLBUS_IPC_DIR={ipc}" in err, err
    assert len(err.strip().splitlines()) == 1, err
