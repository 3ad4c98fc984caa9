"""The auto-update "newer" decision: by first-publish stream sequence, never back."""

from __future__ import annotations

from services.engine.autoupdate import PERMANENT, VersionIndex, newest
from shared.messages import VersionPublished


def _ev(v: str) -> VersionPublished:
    return VersionPublished(model="m", version=v, tp=2)


def _index() -> VersionIndex:
    idx = VersionIndex()
    for seq, v in [(1, "b1"), (2, "b2"), (3, "b3")]:
        idx.add(v, seq)
    return idx


def test_a_never_published_current_is_older_than_anything_published() -> None:
    idx = _index()
    assert idx.is_newer("b1", "v0") and idx.is_newer("b3", "v0")
    assert not idx.is_newer("v0", "v0")


def test_reannounced_old_or_current_version_never_moves_back() -> None:
    idx = _index()
    assert not idx.is_newer("b2", "b3")
    # past the dedup window the same version string comes again at a new sequence
    idx.add("b1", 10)
    idx.add("b3", 11)
    assert idx.seq_of("b1") == 1 and idx.seq_of("b3") == 3
    assert not idx.is_newer("b1", "b3") and not idx.is_newer("b3", "b3")
    assert idx.latest == "b3"  # the default of update_weights does not move back either
    idx.add("b4", 12)
    assert idx.is_newer("b4", "b3") and idx.latest == "b4"


def test_nothing_at_or_below_a_served_sequence_applies_again() -> None:
    idx = _index()
    assert not idx.is_newer("b3", "b3")  # serving b3 (seq 3) ...
    # ... then an operator rolls back to b1: a re-announced b2 is still not newer
    assert not idx.is_newer("b2", "b1")
    idx.add("b5", 20)
    assert idx.is_newer("b5", "b1")


def test_learned_out_of_order_keeps_the_first_sequence() -> None:
    idx = VersionIndex()
    idx.add("b1", 10)  # the re-announcement seen first
    idx.add("b2", 5)
    assert idx.latest == "b1"
    idx.add("b1", 1)  # its first announcement
    assert idx.seq_of("b1") == 1 and idx.latest == "b2"
    assert not idx.is_newer("b1", "b2")


def test_newest_of_a_burst_by_first_sequence() -> None:
    idx = _index()
    idx.add("b1", 10)
    burst = [(3, _ev("b3")), (10, _ev("b1"))]
    assert newest(burst, idx) == burst[0]
    assert newest([], idx) is None


def test_only_bad_versions_are_permanent_failures() -> None:
    assert PERMANENT == {400, 404, 422}  # 409 / 5xx / timeouts are retried
