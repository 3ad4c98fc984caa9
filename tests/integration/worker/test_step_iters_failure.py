"""A step of several decode iterations whose rank 0 sampling raises: rank 0's flag in the
token share stops its peers too (no rank enters the next iteration's collectives alone),
and the engine hears rank 0's error, the cause. A peer used to reply an error of its own
("rank 0's sampling failed: not run further"), which raced rank 0's to the engine (the
first reply of a step wins) and, when first, stood in its place: the client's 503 said
nothing of why. Two ranks on a real nats-server; rank 0 answers a little later than its
peer, as it does when the exception's unwinding and logging take longer than a peer's."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np

from services.worker.stepper import Stepper
from shared import messages as m
from shared.bus import Bus
from shared.errors import Timeout
from tests.integration.shared.test_bus import settle

VOCAB = 64
SUBJECT = "rollbus.t.worker.step"


class Model:
    """Each rank's stand-in: rank 0's flag (last of the share) is set, as the all-reduce
    of a real group would give every rank; rank 0 returns from it later than its peer."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def forward(self, weights: Any, kv: Any, batch: Any) -> Any:
        logits = np.random.default_rng(0).normal(size=(len(batch.token_ids), VOCAB))
        return SimpleNamespace(numpy=lambda: logits.astype(np.float32))

    def share_tokens(self, tokens: list[int]) -> list[int]:
        if self.rank == 0:
            time.sleep(0.5)
        return [*tokens[:-1], 1]


class Rank0(Stepper):
    def _sample(self, *args: object, **kw: object) -> Any:
        raise ValueError("sampling broke: the cause")


def state(rank: int) -> Any:
    return SimpleNamespace(
        weights=SimpleNamespace(version="", current={}),
        kv=SimpleNamespace(allocated=True, keys=[], values=[], num_blocks=4, block_size=16),
        cfg=SimpleNamespace(vocab_size=VOCAB),
        model=Model(rank),
    )


async def test_the_engine_hears_rank_0s_error_not_a_peers_echo(nats_url: str) -> None:
    buses = [await Bus.connect(nats_url, f"rank{r}") for r in (0, 1)]
    engine_bus = await Bus.connect(nats_url, "engine")
    pools = [ThreadPoolExecutor(1) for _ in (0, 1)]
    try:
        ranks = [
            Rank0(state(0), buses[0], pools[0], 0),  # type: ignore[arg-type]
            Stepper(state(1), buses[1], pools[1], 1),  # type: ignore[arg-type]
        ]
        for r, st in enumerate(ranks):
            await buses[r].subscribe(SUBJECT, st.on_step, queue=f"rank{r}")
            await buses[r].flush()
        await settle(engine_bus, *(b.nc for b in buses))
        spec = m.SamplingSpec(0, temperature=0.0)
        step = m.StepRequest(1, [m.StepRow(0, [1], 0, [0], [spec])], iters=3)
        sent = await engine_bus.send(SUBJECT, m.pack(step))
        rep = m.unpack((await sent.reply(10)).data, type=m.StepReply)
        assert "rank 0" in rep.error and "sampling broke: the cause" in rep.error, rep
        # the peer stopped after that iteration, without an answer of its own
        sent = await engine_bus.send(SUBJECT, m.pack(m.StepRequest(2, [])))
        rep = m.unpack((await sent.reply(10)).data, type=m.StepReply)
        assert not rep.error and rep.step == 2
    except Timeout:
        raise AssertionError("no reply") from None
    finally:
        await engine_bus.close()
        for b in buses:
            await b.close()
        for p in pools:
            p.shutdown()
        await asyncio.sleep(0)
