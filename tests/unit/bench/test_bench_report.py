"""The benchmark tables: medians with min-max, per-run ratios, targets, README rewrite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench import report
from tests.bench.common import Table, missed


def _doc() -> dict:
    t = Table("pull", "Pull", "MiB/s")
    t.add("raw", values=[100.0, 200.0, 100.0, 100.0, 100.0])
    t.add("ours", values=[110.0, 150.0, 90.0, 120.0, 105.0], baseline="raw", target=(">=", 1.0))
    t.add("ours sha", values=[80.0, 160.0, 85.0, 80.0, 85.0], baseline="raw",
          target=(">=", 0.9))
    return {"meta": {"runs": 5, "created": "2026-11-30T00:00:00Z"}, "tables": [t.to_json()]}


def test_cells_are_medians_with_min_max_and_ratios_per_run() -> None:
    rows = {r["name"]: r for r in _doc()["tables"][0]["rows"]}
    assert rows["raw"]["median"] == 100.0 and rows["raw"]["min"] == 100.0
    assert rows["raw"]["max"] == 200.0 and rows["raw"]["n"] == 5
    # per-run ratios 1.1, 0.75, 0.9, 1.2, 1.05: median 1.05, not 110/100
    ours = rows["ours"]["ratio"]
    assert ours["median"] == pytest.approx(1.05)
    assert ours["min"] == pytest.approx(0.75) and ours["max"] == pytest.approx(1.2)
    assert rows["ours"]["status"] == "met"
    # per-run ratios 0.8, 0.8, 0.85, 0.8, 0.85: median 0.8 < 0.9
    assert rows["ours sha"]["status"] == "MISSED"
    assert rows["raw"]["status"] is None


def test_missed_targets_are_printed_as_missed() -> None:
    doc = _doc()
    lines = missed(doc["tables"])
    assert len(lines) == 1 and lines[0].startswith("MISSED: Pull: ours sha")
    text = report.render(doc)
    assert "| ours sha | 85.0 (80.0–160) | 0.800× (0.800–0.850) | raw | >= 0.9×: **MISSED** |" \
        in text
    assert "**met**" in text and "Targets missed in this run" in text


def test_readme_section_rewritten_between_markers(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_doc()))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nintro\n{report.BEGIN}\nold tables\n{report.END}\n\n## Next\n")
    assert report.main([str(bench), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old tables" not in text and "| ours |" in text
    assert text.startswith("# x\n\nintro\n") and text.endswith(f"{report.END}\n\n## Next\n")
    # idempotent: the same input gives the same README
    assert report.main([str(bench), "--readme", str(readme)]) == 0
    assert readme.read_text() == text


def test_readme_without_markers_is_an_error(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_doc()))
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert report.main([str(bench), "--readme", str(readme)]) == 2
    assert readme.read_text() == "# no markers\n"
