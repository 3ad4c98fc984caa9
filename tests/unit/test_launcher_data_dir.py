"""``rollbus serve`` with a DATA_DIR it cannot create: one line naming it, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.launcher import serve
from shared.settings import Settings


def test_data_dir_not_creatable_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was a FileNotFoundError / NotADirectoryError traceback (``/proc/x``, a file's
    child): the mkdir runs before the launcher and its LaunchError handling."""
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "data"
    assert serve(Settings(data_dir=bad)) == 2
    err = capsys.readouterr().err
    assert "ROLLBUS_DATA_DIR" in err and str(bad) in err, err
    assert len(err.strip().splitlines()) == 1, err
