"""``model_config`` answers the model dir's ``config.json`` as it is on disk now, without
reading and parsing it on every call: re-read only when its stat (inode, size, mtime)
changed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.engine.control import HFConfigs
from shared.model_config import ConfigError


def test_the_config_is_read_again_only_when_the_file_changed(tmp_path: Path) -> None:
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"vocab_size": 10}))
    c = HFConfigs()
    first = c.read(tmp_path)
    assert first == {"vocab_size": 10}
    assert c.read(tmp_path) is first  # unchanged: the copy held
    st = f.stat()
    f.write_text(json.dumps({"vocab_size": 11}))  # same size; mtime set to differ
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert c.read(tmp_path) == {"vocab_size": 11}
    tmp = tmp_path / "new.json"
    tmp.write_text(json.dumps({"vocab_size": 12}))
    os.utime(tmp, ns=(st.st_atime_ns, f.stat().st_mtime_ns))  # same mtime and size
    tmp.replace(f)  # an atomic replace: another inode
    assert c.read(tmp_path) == {"vocab_size": 12}


def test_a_missing_or_bad_config_is_the_readers_error(tmp_path: Path) -> None:
    c = HFConfigs()
    with pytest.raises(ConfigError, match="no config.json"):
        c.read(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        c.read(tmp_path)
