"""Files the embedded nats-server leaves under ``DATA_DIR`` are private whatever the
umask: its log (``DATA_DIR/nats.log``) sits beside the store, in a directory others may
read, and records every client's failed logins and permission violations (user names,
subjects, addresses)."""

from __future__ import annotations

import os
from pathlib import Path

from services import natsd


def test_the_server_log_is_private_under_an_open_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)  # the usual default: files 0644
    try:
        for existing in (False, True):  # created here; or left 0644 by an older release
            log = tmp_path / f"nats-{existing}.log"
            if existing:
                log.write_text("")
                log.chmod(0o644)
            server = natsd.start(
                tmp_path / f"store-{existing}",
                port=0,
                log_file=log,
                users={"api": ("api", "pw-api")},
            )
            try:
                assert log.stat().st_mode & 0o777 == 0o600, oct(log.stat().st_mode)
            finally:
                server.stop()
            assert "Server is ready" in log.read_text()  # it is the server's log
    finally:
        os.umask(old)
