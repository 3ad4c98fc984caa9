"""The engine's view of the ranks (what ``status`` answers from): fresh reports only are
alive, a silent rank says for how long, a late answer to an older round never wins."""

from __future__ import annotations

from services.engine.ranks import RankView


def test_a_fresh_report_is_alive_with_its_age() -> None:
    v = RankView(2, 0.25)
    rnd = v.begin()
    v.record(rnd, 0, {"rank": 0, "version": "v1", "busy": ""}, at=100.0)
    v.record(rnd, 1, {"rank": 1, "version": "v1", "busy": "step 7"}, at=100.0)
    e = [v.entry(r, now=100.2) for r in (0, 1)]
    assert all(x["alive"] for x in e) and [x["age_ms"] for x in e] == [200.0, 200.0]
    assert e[1]["busy"] == "step 7" and "reason" not in e[1]


def test_a_stale_report_is_not_alive_and_names_the_silence() -> None:
    v = RankView(1, 0.25)
    assert v.stale_s == 1.0  # max(3 x refresh, 1 s)
    v.record(v.begin(), 0, {"rank": 0, "version": "v1"}, at=100.0)
    e = v.entry(0, now=102.1)
    assert e["alive"] is False and e["reason"].startswith("no report for 2.1 s"), e
    assert e["version"] == "v1" and e["age_ms"] == 2100.0  # what it last said, and when
    assert RankView(1, 2.0).stale_s == 6.0


def test_a_rank_that_missed_its_last_round_is_not_alive_until_it_answers() -> None:
    v = RankView(1, 0.25)
    v.record(v.begin(), 0, {"rank": 0}, at=100.0)
    v.miss(v.begin(), 0, "did not answer status within 1 s")
    e = v.entry(0, now=100.1)  # young report, but the newer round got nothing
    assert e["alive"] is False and "did not answer status within 1 s" in e["reason"]
    v.record(v.begin(), 0, {"rank": 0}, at=101.0)
    assert v.entry(0, now=101.0)["alive"] is True


def test_an_older_round_answering_late_never_replaces_a_newer_report() -> None:
    v = RankView(1, 0.25)
    old, new = v.begin(), v.begin()
    v.record(new, 0, {"rank": 0, "version": "v2"}, at=100.0)
    v.record(old, 0, {"rank": 0, "version": "v1"}, at=100.1)  # sent before the update
    assert v.entry(0, now=100.1)["version"] == "v2"
    v.miss(old, 0, "did not answer")  # an older round's silence says nothing either
    assert v.entry(0, now=100.1)["alive"] is True


def test_no_report_yet() -> None:
    v = RankView(2, 0.25)
    assert v.entries() == [
        {"rank": r, "alive": False, "age_ms": None, "reason": "no report yet"} for r in (0, 1)
    ]


def test_an_exited_rank_says_so_whatever_the_age_of_its_last_report() -> None:
    """The exit is the fact (seen at once through the shared pid space); a caller that
    comes later than the staleness bound (a loaded host) still reads it, not silence."""
    import subprocess
    import sys

    from shared import procs

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # exited and reaped
    v = RankView(1, 0.25)
    v.record(v.begin(), 0, {"rank": 0, "pid": p.pid, "pid_space": procs.pid_space()}, at=100.0)
    for now in (100.1, 102.1):  # fresh, and past the 1 s bound
        e = v.entry(0, now=now)
        assert e["alive"] is False and e["reason"] == f"its process {p.pid} has exited", e
    v.miss(v.begin(), 0, "did not answer status within 1 s")
    assert v.entry(0, now=100.1)["reason"] == f"its process {p.pid} has exited"
