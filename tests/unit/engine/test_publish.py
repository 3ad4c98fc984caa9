"""The engine's output path (``Generation._publish``): the API's requests get one batched
message per step per reply inbox; a coalesced request's tokens are held and sent every
``COALESCE_STEPS`` steps (first and last at once); anything else (a raw NATS client, a
JSON one) gets one message per chunk exactly as before."""

from __future__ import annotations

from typing import Any

import msgspec
import nats.errors

from services.engine.generation import COALESCE_STEPS
from services.engine.scheduler import Output, Seq
from shared import messages as m
from shared.bus import REQUEST_ID, BatchItem
from tests.unit.engine.test_step_lock import engine

_items = msgspec.msgpack.Decoder(list[BatchItem])


class Wire:
    """The engine's bus: records every message published; one past ``max_payload``
    fails as nats-py's publish does."""

    max_payload = 1 << 20

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, str] | None]] = []

    async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
        if len(data) > self.max_payload:
            raise nats.errors.MaxPayloadError
        self.sent.append((subject, data, headers))

    def chunks(self) -> dict[str, list[m.GenChunk]]:
        """Every chunk a receiver gets, by reply subject (batches taken apart)."""
        out: dict[str, list[m.GenChunk]] = {}
        for subject, data, headers in self.sent:
            if subject.endswith(".batch"):
                prefix = subject.rsplit(".", 1)[0]
                for token, rid, item in _items.decode(data):
                    chunk = m.unpack(item, type=m.GenChunk)
                    assert chunk.request_id == rid
                    out.setdefault(f"{prefix}.{token}", []).append(chunk)
            else:
                chunk = (
                    m.json_decode(data, type=m.GenChunk) if data[:1] == b"{"
                    else m.unpack(data, type=m.GenChunk)
                )
                assert headers == {REQUEST_ID: chunk.request_id}
                out.setdefault(subject, []).append(chunk)
        return out


def setup() -> tuple[Any, Wire]:
    eng = engine()
    eng.bus = Wire()
    return eng.scheduler, eng.bus


def add(g: Any, rid: str, reply: str, n: int = 1, **kw: Any) -> list[Seq]:
    gen = m.GenRequest(rid, [1, 2, 3], 64, n=n, **kw)
    return g.sched.add(gen, reply).seqs  # type: ignore[no-any-return]


def step(seqs: list[Seq], token: int, end: bool = False) -> list[Output]:
    return [Output(s, token, -0.5, "length" if end else None) for s in seqs]


async def test_one_message_per_step_per_inbox_each_request_gets_its_own() -> None:
    g, wire = setup()
    a = add(g, "a", "_INBOX_api.X.t1", batch=True)
    b = add(g, "b", "_INBOX_api.X.t2", batch=True, n=2)
    c = add(g, "c", "_INBOX_api.Y.t3", batch=True)  # another API process
    raw = add(g, "raw", "_INBOX.Z.t4")  # a raw NATS client: no batch asked
    js = add(g, "js", "_INBOX.Z.t5", batch=True)
    g._json_replies["_INBOX.Z.t5"] = 0.0  # came as JSON: its chunks go back as JSON
    everyone = a + b + c + raw + js
    for t in range(3):
        await g._publish(step(everyone, 10 + t, end=t == 2))
    subjects = [s for s, _, _ in wire.sent]
    # per step: raw's and js's own, one batch to X (a, b's two choices), one to Y
    assert subjects == 3 * [
        "_INBOX.Z.t4", "_INBOX.Z.t5", "_INBOX_api.X.batch", "_INBOX_api.Y.batch"
    ], subjects
    got = wire.chunks()
    assert [c.request_id for c in got["_INBOX_api.X.t1"]] == ["a"] * 3
    assert [(c.request_id, c.index) for c in got["_INBOX_api.X.t2"]] == [
        ("b", 0), ("b", 1)
    ] * 3
    for reply in got:
        for i in range(2):  # each choice: its tokens in order, the last one final
            mine = [c for c in got[reply] if c.index == i]
            if mine:
                assert [c.token_ids for c in mine] == [[10], [11], [12]]
                assert [c.finish_reason for c in mine] == [None, None, "length"]
    assert wire.sent[1][1][:1] == b"{"  # JSON to a JSON client


async def test_coalesced_tokens_go_first_then_every_k_steps_and_all_at_the_end() -> None:
    g, wire = setup()
    seqs = add(g, "r", "_INBOX_api.X.t1", batch=True, coalesce=True, logprobs=True)
    steps = 2 * COALESCE_STEPS + 5
    for t in range(steps):
        await g._publish(step(seqs, t, end=t == steps - 1))
    chunks = wire.chunks()["_INBOX_api.X.t1"]
    # the first at once, then one per COALESCE_STEPS, then the rest with the end
    assert [len(c.token_ids) for c in chunks] == [1, COALESCE_STEPS, COALESCE_STEPS, 4]
    assert len(wire.sent) == 4
    assert [t for c in chunks for t in c.token_ids] == list(range(steps))
    assert [lp for c in chunks for lp in c.logprobs or []] == [-0.5] * steps
    assert [c.finish_reason for c in chunks] == [None, None, None, "length"]
    assert not g._held  # nothing kept after the end


async def test_a_coalesced_request_ended_early_gets_every_held_token() -> None:
    """A cancel / pause abort ends a coalesced request mid-hold (``_end``): the tokens
    held go out with its end; a failure sends the error at once and keeps nothing."""
    g, wire = setup()
    seqs = add(g, "r", "_INBOX_api.X.t1", batch=True, coalesce=True)
    for t in range(5):
        await g._publish(step(seqs, t))
    for s in seqs:
        s.finish_reason = "abort"
    await g._end(seqs)
    chunks = wire.chunks()["_INBOX_api.X.t1"]
    assert [c.token_ids for c in chunks] == [[0], [1, 2, 3, 4]]
    assert chunks[-1].finish_reason == "abort"
    assert not g._held
    other = add(g, "e", "_INBOX_api.X.t2", batch=True, coalesce=True)
    for t in range(3):
        await g._publish(step(other, t))
    await g._publish([Output(other[0], None, None, None, error=(503, "rank failed"))])
    last = wire.chunks()["_INBOX_api.X.t2"][-1]
    assert (last.error_code, last.token_ids) == (503, [])
    assert not g._held


async def test_a_weight_update_mid_hold_sends_the_old_versions_tokens_first() -> None:
    """A chunk carries one version: tokens of two versions never share one."""
    g, wire = setup()
    seqs = add(g, "r", "_INBOX_api.X.t1", batch=True, coalesce=True)
    for t in range(4):
        await g._publish(step(seqs, t))
    g.engine.state.weight_version = "v1"
    for t in range(4, 6):
        await g._publish(step(seqs, t, end=t == 5))
    chunks = wire.chunks()["_INBOX_api.X.t1"]
    assert [(c.version, c.token_ids) for c in chunks] == [
        ("v0", [0]), ("v0", [1, 2, 3]), ("v1", [4, 5])
    ]


async def test_a_batch_past_max_payload_goes_as_several_messages_in_order() -> None:
    """A pause that aborts thousands of queued choices of one API process at once (the
    engine's batch to that inbox is then megabytes): several messages, each within the
    server's max_payload, every end delivered once and in order; one message would fail
    the publish and leave every request waiting for an end that never comes."""
    g, wire = setup()
    wire.max_payload = 64 * 1024
    seqs = []
    for r in range(40):
        seqs += add(g, f"req-{r:03d}", f"_INBOX_api.X.t{r}", batch=True, n=64)
    for s in seqs:
        s.finish_reason = "abort"
    await g._end(seqs)  # 2560 ends, ~600 KiB of chunks
    assert len(wire.sent) > 1
    assert all(len(data) <= wire.max_payload for _, data, _ in wire.sent)
    assert {subject for subject, _, _ in wire.sent} == {"_INBOX_api.X.batch"}
    got = wire.chunks()
    assert sorted(got) == sorted(f"_INBOX_api.X.t{r}" for r in range(40))
    for r in range(40):
        mine = got[f"_INBOX_api.X.t{r}"]
        assert [(c.request_id, c.index, c.finish_reason) for c in mine] == [
            (f"req-{r:03d}", i, "abort") for i in range(64)
        ]
