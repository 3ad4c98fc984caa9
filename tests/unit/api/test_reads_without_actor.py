"""The API sends its reads to the engine without ``Rollbus-Actor`` (``deps.READS``): the
engine must never need the caller of one — no audit event (only exclusive methods record
one) and no handler taking ``actor``. A method that gains either must leave ``READS``, or
its caller would silently be recorded as ``nats``."""

from __future__ import annotations

from services.api.deps import ONE_HOP, READS
from services.engine.main import METHODS, TAKES_ACTOR


def test_reads_need_no_actor() -> None:
    assert "is_paused" in READS
    for method in READS:
        fn, _, exclusive = METHODS[method]  # an engine method (KeyError: renamed)
        assert not exclusive, f"{method} is recorded with its actor"
        assert fn not in TAKES_ACTOR, f"{method}'s handler takes the actor"
        assert method in ONE_HOP, method
