"""The pull benchmark: every row, stock ``ObjectStore.get`` included, has a value in every
run (a cell is a median of >= 5 runs), and the targets of issue 10 sit on what the ranks
do during ``update_weights`` as well as on our reader alone."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench import checkpoint


def test_every_pull_row_is_measured_in_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def raw(url: str, mib: int, flows: int) -> list[dict[str, Any]]:
        return [{"mib_s": 100.0, "t0": 0.0, "t1": 1.0, "bytes": mib << 20}] * flows

    def pull(url: str, objects: list[tuple[str, str | None]], timeout: float = 300,
             extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        seen.extend(sha for _, sha in objects)
        return [{"mib_s": 90.0, "t0": 0.0, "t1": 1.0, "bytes": 1 << 20}] * len(objects)

    monkeypatch.setattr(checkpoint, "raw_flows", raw)
    monkeypatch.setattr(checkpoint, "pullers", pull)
    res: dict[str, list[float]] = {}
    objs = [("m/v/rank0-of-2.safetensors", "aa", 1 << 20),
            ("m/v/rank1-of-2.safetensors", "bb", 1 << 20)]
    for _ in range(5):
        checkpoint.pull_round(res, "nats://x", 1, objs)
    assert seen.count("stock") == 5 and seen.count("stock-into") == 5
    for k in ("update", "stage", "rank", "ranks_agg"):  # what update_weights adds per run
        for v in (False, True):
            res[f"{k}_{v}"] = [50.0] * 5
    one, agg = checkpoint.pull_tables(res, 1, 2.0)
    for t in (one, agg):
        for r in t.to_json()["rows"]:
            assert r["n"] == 5, r["name"]  # no single-run cell
    targets = {r["name"]: r["target"] for r in one.to_json()["rows"] + agg.to_json()["rows"]}
    ranks = {k: v for k, v in targets.items() if "update_weights" in k and "stage" not in k}
    assert len(ranks) == 4
    assert all(v is not None for v in ranks.values())
