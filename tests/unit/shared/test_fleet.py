"""The fleet transaction's pure rules: who may write which decision, the overall status,
the argument structs, the status rows."""

from __future__ import annotations

import pytest

from shared import fleet as f
from shared import messages as m
from shared.errors import ControlError


@pytest.mark.parametrize(
    ("cur", "to", "actor", "ok"),
    [
        ("staged", "commit", "coordinator", True),
        ("staged", "commit", "instance", False),  # only the coordinator commits
        ("staged", "abort", "instance", True),  # a timed-out instance aborts
        ("staged", "abort", "coordinator", True),
        ("commit", "done", "instance", True),  # a timed-out committed instance finishes it
        ("commit", "abort", "coordinator", True),  # a commit failed somewhere
        ("commit", "abort", "instance", False),  # an instance never undoes a decision
        ("abort", "commit", "coordinator", False),  # a late coordinator cannot commit
        ("abort", "done", "instance", False),
        ("done", "abort", "coordinator", False),
        ("staged", "done", "instance", False),
    ],
)
def test_allowed_decisions(cur: str, to: str, actor: str, ok: bool) -> None:
    assert f.allowed(cur, to, actor) is ok


def _o(name: str, code: int = 200, phase: str = "", version: str = "v1") -> f.Outcome:
    return f.Outcome(name, "x", "v0", version, code, f"{name} failed" if code != 200 else "",
                     phase)


def test_overall_200_only_when_done_and_everyone_switched() -> None:
    assert f.overall([_o("a"), _o("b")], "done", "v1") == (200, "")
    code, msg = f.overall([_o("a"), _o("b", version="v0")], "done", "v1")
    assert code == 503 and "b" in msg
    code, _ = f.overall([_o("a", version="v0")], "abort", "v1")
    assert code == 503


def test_overall_is_the_first_failure_stage_before_commit() -> None:
    outs = [_o("a", 503, "commit", "v0"), _o("b", 404, "stage", "v0"), _o("c", 422, "stage")]
    code, msg = f.overall(outs, "abort", "v1")
    assert code == 404  # b's stage failure comes first (stage, then by name)
    assert "a failed" in msg and "b failed" in msg and "c failed" in msg


def test_update_args_refuse_unknown_fields_and_bad_modes() -> None:
    a = m.decode_args(b'{"version": "v1"}', f.FleetUpdateArgs)
    assert (a.version, a.pause_mode, a.verify_checksum) == ("v1", "keep", None)
    for bad in (b'{"version": "v1", "x": 1}', b'{"version": ""}', b"{}",
                b'{"version": "v1", "pause_mode": "later"}', b'{"version": 3}'):
        with pytest.raises(ControlError) as e:
            m.decode_args(bad, f.FleetUpdateArgs)
        assert e.value.code == 400


def test_status_rows_and_table() -> None:
    rows = f.status_rows([
        {"instance": "b", "state": "running", "weight_version": "v1", "tp": 1,
         "ranks": [{"alive": True}], "waiting": 2, "running": 1},
        {"instance": "a", "error": "status: no responders"},
    ])
    assert [r["instance"] for r in rows] == ["a", "b"]
    assert rows[0]["state"] == "unreachable"
    assert rows[1] == {"instance": "b", "state": "running", "version": "v1", "ranks": "1/1",
                       "waiting": 2, "running": 1, "error": ""}
    text = f.format_table(rows)
    assert text.splitlines()[0].split() == ["instance", "state", "version", "ranks", "waiting",
                                            "running"]
    assert "a: status: no responders" in text
