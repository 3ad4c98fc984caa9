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
