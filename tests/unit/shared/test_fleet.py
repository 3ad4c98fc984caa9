"""The fleet transaction's pure rules: who may write which decision, the overall status,
the argument structs, the status rows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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


def test_overall_done_and_everyone_on_the_version_is_200_whatever_a_step_said() -> None:
    # review 11 #1: a commit answered 409 but the record says done and it serves v1
    outs = [_o("a", 409, "commit"), _o("b")]
    assert f.overall(outs, "done", "v1") == (200, "")
    assert f.overall([_o("a", 409, "commit", "v0"), _o("b")], "done", "v1")[0] == 409


class MemBucket:
    def __init__(self) -> None:
        self.recs: dict[str, f.Record] = {}
        self.on_decide: Any = None  # (rec, to) -> None: someone else writes first

    async def create(self, rec: f.Record) -> None:
        self.recs[rec.txn] = rec

    async def decide(self, txn: str, to: str, actor: str, reason: str) -> f.Record | None:
        r = self.recs[txn]
        if self.on_decide:
            self.on_decide(r, to)
        if r.decision != to and f.allowed(r.decision, to, actor):
            r.decision = to  # type: ignore[assignment]
        return r


class Scripted(f.Coordinator):
    """The real Coordinator.update with scripted instance replies."""

    def __init__(self, script: dict[tuple[str, str], tuple[int, str, dict[str, Any]]]) -> None:
        super().__init__(SimpleNamespace(nc=None, name="t"), 1.0)
        self.bucket = MemBucket()  # type: ignore[assignment]
        self.script, self.calls = script, []  # type: list[tuple[str, str]]

    async def call(self, instance: str, method: str, args: Any, timeout: float
                   ) -> tuple[int, str, dict[str, Any]]:
        self.calls.append((instance, method))
        return self.script.get((instance, method), (200, "", {}))


async def test_a_commit_409_under_a_done_record_is_a_switch() -> None:
    """Review 11 #1: a's watchdog finished the transaction (record ``done``) while the
    coordinator's commit got 409: every instance serves v1, so 200 and no error rows."""
    on = {"weight_version": "v1"}
    c = Scripted({
        ("a", "fleet_stage"): (200, "", {"previous_version": "v0"}),
        ("b", "fleet_stage"): (200, "", {"previous_version": "v0"}),
        ("a", "fleet_commit"): (409, "fleet_commit: another control operation is in progress",
                                {}),
        ("a", "fleet_finalize"): (200, "", {**on, "finalized": False}),
        ("b", "fleet_finalize"): (200, "", {**on, "finalized": True}),
    })

    def watchdog_first(rec: f.Record, to: str) -> None:
        if to == "abort" and rec.decision == "commit":
            rec.decision = "done"  # a's watchdog wrote it first

    c.bucket.on_decide = watchdog_first  # type: ignore[attr-defined]
    res = await c.update("v1", instances=["a", "b"])
    assert (res.decision, res.error_code, res.error_message) == ("done", 200, "")
    assert [(o.outcome, o.version, o.error_code) for o in res.instances] == [
        ("switched", "v1", 200), ("switched", "v1", 200)]


async def test_the_losing_transaction_claims_no_versions() -> None:
    """Review 11 #10: an instance busy in another transaction (409 at stage) was never in
    this one: ``not_started``, no version read mid-way through the winner."""
    c = Scripted({
        ("a", "fleet_stage"): (409, "fleet transaction fX is in progress", {}),
        ("b", "fleet_stage"): (200, "", {"previous_version": "v0"}),
        ("a", "fleet_abort"): (200, "", {"weight_version": "v2", "aborted": False}),
        ("b", "fleet_abort"): (200, "", {"weight_version": "v0", "aborted": True}),
    })
    res = await c.update("v1", instances=["a", "b"])
    assert res.decision == "abort" and res.error_code == 409
    a, b = res.instances
    assert (a.outcome, a.version, a.previous_version) == ("not_started", "", "")
    assert (b.outcome, b.version) == ("stayed", "v0")


@pytest.mark.parametrize(
    ("kw", "param"),
    [({"version": "../x"}, "version"), ({"version": "a/b"}, "version"),
     ({"version": ""}, "version"), ({"version": "x" * 300}, "version"),
     ({"version": "v1", "pause_mode": "later"}, "pause_mode")],
)
async def test_bad_arguments_refused_before_anything(kw: dict[str, Any], param: str) -> None:
    """Review 11 #6/#9: no record, no pause, for a name no rank could load."""
    c = Scripted({})
    with pytest.raises(ValueError) as e:
        await c.update(instances=["a"], **kw)
    assert isinstance(e.value, ControlError) and e.value.code == 400
    assert f"'{param}'" in e.value.message
    assert c.calls == [] and c.bucket.recs == {}  # type: ignore[attr-defined]
