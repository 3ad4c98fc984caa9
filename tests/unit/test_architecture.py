"""The import-linter contracts (pyproject ``[tool.importlinter]``) hold for the tree, and
they do catch a sideways import: a copy of the tree with one planted import fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = shutil.which("lint-imports") or ""


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT, "--no-cache", "--no-logo"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": str(Path(sys.executable).parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_tree(dst: Path) -> Path:
    for d in ("shared", "services"):
        shutil.copytree(ROOT / d, dst / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


pytestmark = pytest.mark.skipif(not LINT, reason="import-linter is not installed (.[dev])")


def test_tree_keeps_the_contracts() -> None:
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize(
    ("file", "line", "broken"),
    [
        ("services/api/deps.py", "from services.worker import comm", "services.api is not allowed"),
        ("shared/errors.py", "import services.engine.state", "shared is not allowed"),
        ("services/trainer/names.py", "import paddle", "services.trainer is not allowed"),
        ("services/worker/comm.py", "import services.launcher", "services.launcher"),
    ],
)
def test_a_planted_import_breaks_a_contract(
    tmp_path: Path, file: str, line: str, broken: str
) -> None:
    tree = copy_tree(tmp_path)
    with (tree / file).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    r = lint(tree)
    assert r.returncode != 0, r.stdout
    assert broken in r.stdout, r.stdout
