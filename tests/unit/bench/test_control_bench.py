"""The control benchmark compares like with like: the call that asks every rank against a
raw path of the same shape (two hops, one process per rank), engine-only calls against
request/reply, raw replies of the sizes of rollbus's."""

from __future__ import annotations

import subprocess
import sys
import uuid

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout

from tests.bench import control_plane


def _res(tp: int) -> dict[str, list[list[float]]]:
    n = control_plane.names(tp)
    return {n[k]: [[1.0, 2.0, 3.0]] * 5 for k in n if not k.endswith("_vs_scatter")}


def test_rank_reaching_target_is_on_a_call_that_asks_every_rank() -> None:
    n = control_plane.names(2)
    t = control_plane.tables(2, 10, _res(2)).to_json()
    rows = {r["name"]: r for r in t["rows"]}
    # the engine's view answers without asking a rank: against request/reply, no target
    assert rows[n["status"]]["baseline"] == n["req"]
    assert rows[n["status"]]["target"] is None
    # status?fresh asks every rank: <= 1.5x the raw two-hop relay, and the one-hop scatter
    targeted = {r["name"]: (r["baseline"], r["target"]) for r in t["rows"] if r["target"]}
    assert targeted[n["fresh"]] == (n["relay"], {"op": "<=", "value": 1.5})
    assert targeted[n["fresh_vs_scatter"]] == (n["scatter"], {"op": "<=", "value": 1.5})
    assert targeted[n["http_is_paused"]] == (n["bare"], {"op": "<=", "value": 1.3})
    assert len(targeted) == 3
    # the engine-view status against the scatter is shown for reference, without a target
    assert rows[n["status_vs_scatter"]]["baseline"] == n["scatter"]
    assert rows[n["status_vs_scatter"]]["target"] is None


def _spawn(url: str, *args: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-m", "tests.bench.responder", url, *args],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and "ready" in p.stdout.readline()
    return p


async def test_relay_answers_after_every_responder_with_the_given_size(nats_url: str) -> None:
    tag = uuid.uuid4().hex[:8]
    relay, scat = f"t.relay.{tag}", f"t.scat.{tag}"
    procs = [_spawn(nats_url, relay, "1", "--size", "700", "--relay", scat, "2"),
             _spawn(nats_url, scat, "1", "0", "--size", "300")]
    nc = await nats.connect(nats_url)
    try:
        # one of the two responders is there: the relay does not answer (it waits for both)
        with pytest.raises(NatsTimeout):
            await nc.request(relay, b"{}", timeout=1.5)
        procs.append(_spawn(nats_url, scat, "1", "1", "--size", "300"))
        rep = await nc.request(relay, b"{}", timeout=10)
        assert len(rep.data) == 700
        # a responder's reply has its size too (a scatter reaches both ranks)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(scat, b"{}", reply=inbox)
        got = [await sub.next_msg(timeout=10) for _ in range(2)]
        assert all(len(m.data) == 300 for m in got)
    finally:
        await nc.close()
        for p in procs:
            p.terminate()
            p.wait()
