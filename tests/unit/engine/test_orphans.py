"""Which reply subjects the engine probes to find requests nobody reads (their API died):
one per inbox prefix for the API's batched requests, one per reply for the others."""

from __future__ import annotations

from services.engine.orphans import probe_targets
from services.engine.scheduler import Request
from shared import messages as m


def req(rid: str, reply: str, batch: bool) -> Request:
    return Request(m.GenRequest(rid, [1], max_tokens=4, batch=batch), reply)


def test_one_probe_per_api_inbox_and_per_raw_reply() -> None:
    reqs = [
        req("a1", "_INBOX_api.A.t1", True),
        req("b1", "_INBOX_api.B.t1", True),
        req("a2", "_INBOX_api.A.t2", True),
        # raw clients, one subscription per request: each probed on its own reply
        req("r1", "_INBOX.x.t1", False),
        req("r2", "_INBOX.x.t2", False),
    ]
    assert probe_targets(reqs) == [
        ("_INBOX_api.A.t1", ["a1", "a2"]),  # the probe carries a1's id: its own reply
        ("_INBOX_api.B.t1", ["b1"]),
        ("_INBOX.x.t1", ["r1"]),
        ("_INBOX.x.t2", ["r2"]),
    ]
