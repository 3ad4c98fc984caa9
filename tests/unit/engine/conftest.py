"""Fixtures shared by the engine's unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model on disk (what an engine's ``Settings.model`` names)."""
    from services.tiny_model import create_model_dir

    return create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
