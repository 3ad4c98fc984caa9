"""Pipelined steps (``ROLLBUS_STEP_PIPELINE``): the engine sends step N+1 before N's reply.

The ranks are stood in for by :class:`Ranks`, which answers steps in the order sent, as
ranks do, and whose "model" makes each next token a function of the row's last input
token and position — so a row fed the wrong token (e.g. a ``prev`` row without the
kept one) changes the output. Every scenario must give what one step at a time gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from services.engine.scheduler import Plan
from shared import messages as m
from tests.unit.engine.test_scheduler import gen, sched
from tests.unit.engine.test_step_lock import engine

VERSIONS = {"v0": 0, "v1": 100}  # a token's range says which weights computed it


class Sent:
    def __init__(self, ranks: Ranks, reply: m.StepReply) -> None:
        self.ranks, self.data, self.done = ranks, m.pack(reply), False

    async def reply(self, timeout: float) -> Any:
        await asyncio.sleep(0.001)  # a step takes time: the next one can be sent meanwhile
        self.drop()
        return SimpleNamespace(data=self.data)

    def drop(self) -> None:
        if not self.done:
            self.done = True
            self.ranks.in_flight -= 1


class Ranks:
    """The bus and the ranks: ``send`` runs the step at once (in order), replies later."""

    def __init__(self) -> None:
        self.kept: dict[int, int] = {}
        self.steps: list[m.StepRequest] = []
        self.chunks: dict[str, list[m.GenChunk]] = {}
        self.in_flight = 0
        self.most_in_flight = 0
        self.on_chunk: Callable[[str, m.GenChunk], None] = lambda rid, c: None

    async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
        chunk = m.unpack(data, type=m.GenChunk)
        if not chunk.heartbeat:
            self.chunks.setdefault(chunk.request_id, []).append(chunk)
            self.on_chunk(chunk.request_id, chunk)

    async def send(self, subject: str, data: bytes, **_: Any) -> Sent:
        req = m.unpack(data, type=m.StepRequest)
        self.steps.append(req)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return Sent(self, self.run(req))

    def run(self, req: m.StepRequest) -> m.StepReply:
        kept, self.kept = self.kept, {}
        ids, tokens = [], []
        lasts = {}  # a step of several decode iterations: each row's token so far
        for it in range(req.iters):
            for row in req.rows:
                if row.prev:
                    assert row.seq_id in kept, f"step {req.step}: no kept token for {row.seq_id}"
                last = kept[row.seq_id] if row.prev else row.token_ids[-1]
                last = lasts.get(row.seq_id, last)
                pos = row.start_pos + row.num_new - 1 + it
                for spec in row.sample:
                    tok = VERSIONS[req.version] + (last * 31 + pos * 7 + spec.salt * 13) % 97 + 1
                    ids.append(spec.seq_id)
                    tokens.append(tok)
                    lasts[spec.seq_id] = tok
        if req.keep:
            self.kept = dict(zip(ids, tokens, strict=False))  # the last iteration's
        return m.StepReply(req.step, ids, tokens, [-0.5] * len(ids))


def requests() -> list[m.GenRequest]:
    return [
        m.GenRequest("a", [5, 6, 7], 12),
        m.GenRequest("b", list(range(1, 20)), 7, n=3, seed=1),  # forks mid-pipeline
        m.GenRequest("c", [9], 30, stop_token_ids=[40]),  # ends on a stop token
        m.GenRequest("d", [3, 4], 1),  # its one token ends it
    ]


async def run(
    pipeline: bool,
    during: Callable[[Any, Ranks], None] | None = None,
    decode_steps: int = 1,
    reqs: list[m.GenRequest] | None = None,
) -> Any:
    eng = engine()
    eng.settings.step_pipeline = pipeline
    eng.settings.decode_steps = decode_steps
    eng.subjects = SimpleNamespace(worker_step="step", gen="gen")
    eng.bus = ranks = Ranks()
    gen = eng.scheduler
    if during:
        during(eng, ranks)
    for g in requests() if reqs is None else reqs:
        gen.sched.add(g, f"inbox.{g.request_id}")
    gen.work.set()
    loop = asyncio.create_task(gen.loop())
    try:
        for _ in range(2000):
            if not gen.sched.requests and not gen.active:
                break
            await asyncio.sleep(0.002)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert not gen.sched.requests and not gen.sched.running
    assert gen.sched.alloc.num_free == eng.settings.kv_cache_blocks
    assert ranks.in_flight == 0
    return eng, ranks


def outputs(ranks: Ranks) -> dict[tuple[str, int], tuple[list[int], str | None]]:
    out: dict[tuple[str, int], tuple[list[int], str | None]] = {}
    for rid, chunks in ranks.chunks.items():
        for c in chunks:
            toks, reason = out.get((rid, c.index), ([], None))
            assert reason is None, f"{rid}/{c.index}: a chunk after its last"
            out[(rid, c.index)] = (toks + list(c.token_ids), c.finish_reason)
    return out


async def test_pipelined_steps_give_what_one_step_at_a_time_gives() -> None:
    _, serial = await run(False)
    _, piped = await run(True)
    assert serial.most_in_flight == 1 and piped.most_in_flight == 2
    assert any(r.prev for s in piped.steps for r in s.rows)
    assert outputs(piped) == outputs(serial)
    out = outputs(piped)
    assert out[("c", 0)][1] == "stop" and out[("c", 0)][0][-1] == 40
    assert out[("d", 0)] == (out[("d", 0)][0], "length") and len(out[("d", 0)][0]) == 1
    assert {len(out[("b", i)][0]) for i in range(3)} == {7}
    # every finished sequence is named to the ranks once (their samplers are dropped)
    named = [sid for s in piped.steps for sid in s.finished]
    assert sorted(named) == sorted(set(named))


async def test_a_cancel_while_a_pipelined_step_is_in_flight() -> None:
    def during(eng: Any, ranks: Ranks) -> None:
        def on_chunk(rid: str, c: m.GenChunk) -> None:
            if rid == "a" and len(ranks.chunks["a"]) == 3:  # e.g. a stop string in the API
                assert ranks.in_flight >= 1
                eng.scheduler._cancels.append("a")

        ranks.on_chunk = on_chunk

    _, piped = await run(True, during)
    a = piped.chunks["a"]
    assert [c.finish_reason for c in a] == [None, None, None, "abort"]
    assert sum(len(c.token_ids) for c in a) == 3  # the sample of the step in flight: dropped
    _, serial = await run(False)
    assert {k: v for k, v in outputs(piped).items() if k[0] != "a"} == {
        k: v for k, v in outputs(serial).items() if k[0] != "a"
    }


async def test_update_between_pipelined_steps_labels_every_token_with_its_weights() -> None:
    seen: list[int] = []

    def during(eng: Any, ranks: Ranks) -> None:
        async def update() -> None:
            async with eng.scheduler.quiet():
                seen.append(ranks.in_flight)  # no step may be in flight now
                eng.state.weight_version = "v1"

        def on_chunk(rid: str, c: m.GenChunk) -> None:
            if rid == "c" and len(ranks.chunks["c"]) == 4:
                asyncio.get_running_loop().create_task(update())

        ranks.on_chunk = on_chunk

    _, piped = await run(True, during)
    assert seen == [0]
    versions = set()
    for chunks in piped.chunks.values():
        for c in chunks:
            for tok in c.token_ids:
                assert c.version == ("v1" if tok > 100 else "v0"), (c, tok)
                versions.add(c.version)
            if c.spans:
                for span in c.spans:
                    assert span.version in VERSIONS
    assert versions == {"v0", "v1"}  # the update came mid-run, not after it


def test_an_ahead_plan_continues_with_the_kept_token_and_skips_what_ends() -> None:
    s = sched()
    s.add(gen("a", prompt=5, max_tokens=2), "i")
    p1 = s.schedule()
    assert p1 is not None
    p2 = s.schedule(ahead=True)
    assert p2 is not None
    (row,) = p2.step.rows
    assert row.prev and row.token_ids == [] and row.start_pos == 5 and row.sample
    # the second token ends it (max_tokens 2): nothing more to plan ahead of p2
    assert s.schedule(ahead=True) is None
    s.apply(p1, m.StepReply(1, [0], [7], [-0.1]), "v0")
    (out,) = s.apply(p2, m.StepReply(2, [0], [8], [-0.2]), "v0")
    assert out.seq.output == [7, 8] and out.finish_reason == "length"


def test_an_ahead_plan_never_preempts() -> None:
    s = sched(blocks=2, bs=4)
    s.add(gen("a", prompt=4, max_tokens=4), "i")
    s.add(gen("b", prompt=4, max_tokens=4), "i")
    p1 = s.schedule()
    assert p1 is not None and len(p1.step.rows) == 2 and s.alloc.num_free == 0
    assert s.schedule(ahead=True) is None and s.preemptions == 0
    s.apply(p1, m.StepReply(1, [0, 1], [7, 7], [-0.1, -0.1]), "v0")
    p2 = s.schedule()  # one step at a time: preempts as before
    assert isinstance(p2, Plan) and s.preemptions == 1


async def test_a_step_of_block_copies_alone_counts_no_iteration() -> None:
    """``step_time.iterations`` counts forward passes: three completions of a 19-token
    prompt (not a whole number of 16-token blocks: the forks copy its last block), one
    token each, end in the prompt's step; the copies go alone in the next step, which
    runs no forward pass. It counted 1 (``iters``' default)."""
    for pipeline in (False, True):
        eng, ranks = await run(pipeline, reqs=[m.GenRequest("b", list(range(1, 20)), 1, n=3)])
        assert [(len(s.rows), len(s.copies)) for s in ranks.steps] == [(1, 0), (0, 2)]
        counts = eng.scheduler.counts()
        assert counts["steps"] == 2 and counts["step_time"]["iterations"] == 1, counts
