"""The staleness bound alone: versions behind, the stricter bound, the scheduler's gate
(new requests wait, started ones go on), the status record and the setting."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.engine import staleness
from services.engine.autoupdate import VersionIndex
from services.engine.scheduler import Scheduler
from shared import messages as m
from shared.settings import Settings
from tests.unit.engine.test_scheduler import fake_reply


def gen(rid: str, max_tokens: int = 4, own: int | None = None, n: int = 1) -> m.GenRequest:
    return m.GenRequest(rid, [1, 2, 3], max_tokens, n=n, max_staleness=own)


def test_versions_behind_counts_later_announcements() -> None:
    seqs = {"v1": 3, "v2": 5, "v3": 9}
    assert staleness.versions_behind(seqs, "v3") == 0
    assert staleness.versions_behind(seqs, "v2") == 1
    assert staleness.versions_behind(seqs, "v1") == 2
    # never announced (the model dir's own version.txt): older than every announced one
    assert staleness.versions_behind(seqs, "v0") == 3
    assert staleness.versions_behind({}, "v0") == 0


def test_versions_behind_uses_the_first_announcement() -> None:
    """A re-announced version (a new sequence after the dedup window) keeps its first
    place: serving it is not "newest", and it is not counted twice."""
    idx = VersionIndex()
    for version, seq in (("a", 1), ("b", 2), ("c", 3), ("a", 4)):
        idx.add(version, seq)
    assert idx.seqs == {"a": 1, "b": 2, "c": 3} and idx.latest == "c"
    assert staleness.versions_behind(idx.seqs, "a") == 2
    assert staleness.versions_behind(idx.seqs, "c") == 0
    before = idx.changes
    idx.add("b", 7)  # a re-announcement changes nothing
    assert idx.changes == before
    idx.add("d", 8)
    assert idx.changes == before + 1 and staleness.versions_behind(idx.seqs, "a") == 3


@pytest.mark.parametrize(
    ("setting", "own", "expected"),
    [(None, None, None), (2, None, 2), (None, 1, 1), (2, 0, 0), (0, 3, 0), (3, 3, 3)],
)
def test_the_stricter_bound_applies(setting: int | None, own: int | None, expected: int) -> None:
    assert staleness.bound(setting, own) == expected


def test_holds_only_beyond_the_bound() -> None:
    assert not staleness.holds(5, None, None)  # no bound
    assert not staleness.holds(0, 0, None)  # on-policy and current
    assert staleness.holds(1, 0, None)
    assert not staleness.holds(2, 2, None) and staleness.holds(3, 2, None)
    assert staleness.holds(1, 2, 0)  # the request's own bound is tighter
    assert staleness.holds(1, 0, 5)  # never looser than the setting


def _sched() -> Scheduler:
    return Scheduler(16, 4, 8, 64, max_model_len=64)


def test_new_requests_wait_while_stale_and_running_ones_continue() -> None:
    s = _sched()
    s.add(gen("old", max_tokens=5), "i")
    plan = s.schedule(behind=0, max_staleness=0)
    assert plan is not None and [q.req.request_id for q in plan.seqs] == ["old"]
    s.apply(plan, fake_reply(plan), "v0")
    # a version is announced: one behind, bound 0 -> a new request waits, "old" goes on
    s.add(gen("new"), "i")
    assert s.held(1, 0) == 1
    while "old" in s.requests:
        plan = s.schedule(behind=1, max_staleness=0)
        assert plan is not None and [q.req.request_id for q in plan.seqs] == ["old"]
        s.apply(plan, fake_reply(plan), "v0")
    assert "new" in s.requests and not s.requests["new"].started
    assert s.counts()["queued"] == 1
    # "old" finished; nothing can run: no step at all, "new" still queued
    plan = s.schedule(behind=1, max_staleness=0)
    assert plan is None or not plan.step.rows
    # updated: within the bound again, it starts
    plan = s.schedule(behind=0, max_staleness=0)
    assert plan is not None and [q.req.request_id for q in plan.seqs] == ["new"]
    assert s.held(0, 0) == 0


def test_a_bound_of_k_allows_k_versions_behind() -> None:
    s = _sched()
    s.add(gen("a"), "i")
    assert s.schedule(behind=3, max_staleness=2) is None
    plan = s.schedule(behind=2, max_staleness=2)
    assert plan is not None and plan.seqs[0].req.request_id == "a"


def test_a_requests_own_bound_is_tighter_and_others_are_not_held_up() -> None:
    s = _sched()
    s.add(gen("strict", own=0), "i")  # queued first
    s.add(gen("loose", own=None), "i")
    s.add(gen("looser_than_setting", own=9), "i")
    assert s.held(1, 2) == 1
    plan = s.schedule(behind=1, max_staleness=2)
    assert plan is not None
    assert sorted(q.req.request_id for q in plan.seqs) == ["loose", "looser_than_setting"]
    # the setting is the ceiling: a request cannot loosen it
    assert s.held(3, 2) == 1  # "strict" (the others started)
    s2 = _sched()
    s2.add(gen("x", own=9), "i")
    assert s2.schedule(behind=3, max_staleness=2) is None
    # no setting: the request's own bound alone
    s3 = _sched()
    s3.add(gen("y", own=1), "i")
    assert s3.schedule(behind=2) is None
    assert s3.schedule(behind=1) is not None


def test_preempted_and_forked_sequences_are_not_held() -> None:
    """Started requests (a preempted sequence re-queued, the n-1 forks) are "running"
    for the bound: they continue whatever the staleness."""
    s = Scheduler(4, 4, 8, 64, max_model_len=64)
    s.add(gen("a", max_tokens=4, n=2), "i")
    plan = s.schedule()
    assert plan is not None
    s.apply(plan, fake_reply(plan), "v0")  # forks the second choice
    s.recompute_all()  # weights changed: both re-queued (started)
    plan = s.schedule(behind=5, max_staleness=0)
    assert plan is not None and {q.index for q in plan.seqs} == {0, 1}


def test_report_record() -> None:
    r = staleness.Staleness(behind=2, max_staleness=1, newest="v3", serving="v1", waiting=4)
    assert r.stale and r.to_dict() == {
        "behind": 2,
        "max_staleness": 1,
        "stale": True,
        "newest": "v3",
        "serving": "v1",
        "waiting": 4,
    }
    assert not staleness.Staleness(9, None, "v9", "v0", 0).stale


def test_setting_unset_empty_and_bad(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLBUS_MAX_STALENESS", raising=False)
    assert Settings().max_staleness is None
    assert Settings().to_env()["ROLLBUS_MAX_STALENESS"] == ""  # children read it back unset
    monkeypatch.setenv("ROLLBUS_MAX_STALENESS", "")
    assert Settings().max_staleness is None
    monkeypatch.setenv("ROLLBUS_MAX_STALENESS", "0")
    assert Settings().max_staleness == 0 and Settings().to_env()["ROLLBUS_MAX_STALENESS"] == "0"
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv("ROLLBUS_MAX_STALENESS", bad)
        with pytest.raises(ValidationError):
            Settings()


def test_gen_message_checks_max_staleness() -> None:
    ok = m.unpack(m.pack(gen("a", own=3)), type=m.GenRequest)
    assert ok.max_staleness == 3
    assert m.unpack(m.pack(gen("a")), type=m.GenRequest).max_staleness is None
    bad = m.pack({"request_id": "a", "prompt_token_ids": [1], "max_tokens": 1, "max_staleness": -1})
    with pytest.raises(Exception, match="max_staleness"):
        m.unpack(bad, type=m.GenRequest)
