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
        {"instance": "b", "state": "running", "weight_version": "v1", "tp": 1, "model": "m",
         "ranks": [{"alive": True}], "waiting": 2, "running": 1},
        {"instance": "a", "error": "status: no responders"},
    ])
    assert [r["instance"] for r in rows] == ["a", "b"]
    assert rows[0]["state"] == "unreachable"
    assert rows[1] == {"instance": "b", "model": "m", "state": "running", "version": "v1",
                       "ranks": "1/1",
                       "waiting": 2, "running": 1, "error": ""}
    text = f.format_table(rows)
    assert text.splitlines()[0].split() == ["instance", "model", "state", "version", "ranks",
                                            "waiting", "running"]
    assert "a: status: no responders" in text


# ------------------------------------------------------------------ membership


def test_member_key_is_one_valid_kv_token_per_name() -> None:
    import re

    names = ["a", "fleet-1", "a.b", "a_b", "a_2eb", "x/y z", "é", "名"]
    keys = [f.member_key(n) for n in names]
    assert keys[0] == "members.a" and keys[1] == "members.fleet-1"
    assert len(set(keys)) == len(keys)  # "a.b", "a_b" and "a_2eb" do not collide
    for k in keys:
        assert re.fullmatch(r"members\.[A-Za-z0-9_-]+", k), k


def test_member_period_and_window() -> None:
    assert f.member_period(9.0) == 3.0 and f.member_period(0.3) == 0.5
    assert f.member_window(8.0) == 24.0
    m = f.Member("a", last_seen=100.0)
    assert f.member_live(m, 124.0, 24.0) and not f.member_live(m, 124.1, 24.0)


def test_merge_adds_fresh_members_that_missed_discovery() -> None:
    found = [f.Instance("b", model="tiny")]
    members = [
        f.Member("b", "tiny", last_seen=0.0),  # discovered: its stale record changes nothing
        f.Member("c", "tiny", last_seen=95.0),  # silent, fresh: a member, unreachable
        f.Member("d", "tiny", last_seen=50.0),  # silent, stale (crashed long ago): gone
    ]
    out = f.merge(found, members, now=100.0, window=24.0)
    assert [(i.instance, i.model, i.reachable) for i in out] == [
        ("b", "tiny", True), ("c", "tiny", False)]
    assert f.merge(found, [], 100.0, 24.0) == found


def test_select_by_model_or_names() -> None:
    fleet = [f.Instance("a", model="tiny"), f.Instance("b", model="other"),
             f.Instance("c", model="tiny", reachable=False)]
    assert [i.instance for i in f.select(fleet, "tiny", None)] == ["a", "c"]
    assert [i.instance for i in f.select(fleet, None, None)] == ["a", "b", "c"]
    assert f.select(fleet, "nope", None) == []
    named = f.select(fleet, "tiny", ["b", "zz", "b"])  # names win over the model
    assert [(i.instance, i.reachable) for i in named] == [("b", True), ("zz", False)]
    assert f.models_of(fleet) == ["other", "tiny"]


def test_mark_unreachable_only_silent_503s() -> None:
    outs = [_o("a", 503, "stage", "v0"), _o("c", 503, "stage", "v0"), _o("d", 404, "stage")]
    f.mark_unreachable(outs, {"c", "d"})
    assert [o.outcome for o in outs] == ["x", "unreachable", "x"]
