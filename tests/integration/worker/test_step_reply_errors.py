"""A rank whose step reply cannot be published (here: larger than a real nats-server's
``max_payload``) counts it as a callback error of the step subject, like any other
callback failure (so ``ping``/``status`` ``callback_errors`` and /metrics show it), and
answers a short error instead: the engine fails the step at once, not after its timeout."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from services import natsd
from services.worker.stepper import Stepper
from shared import messages as m
from shared.bus import Bus
from tests.integration.shared.test_bus import settle
from tests.natsconf import free_port

MAX_PAYLOAD = 4096
VOCAB = 64
SUBJECT = "rollbus.t.worker.step"


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A nats-server whose max_payload is 4 KiB."""
    tmp = Path(tmp_path_factory.mktemp("small-nats"))
    port = free_port()
    conf = tmp / "server.conf"
    conf.write_text(f"listen: 127.0.0.1:{port}\nmax_payload: {MAX_PAYLOAD}\n")
    proc = subprocess.Popen(  # noqa: S603
        [natsd.find_binary(), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while natsd.port_is_free("127.0.0.1", port):
            assert proc.poll() is None and time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


class Model:
    def forward(self, weights: Any, kv: Any, batch: Any) -> Any:
        logits = np.random.default_rng(0).normal(size=(len(batch.token_ids), VOCAB))
        return SimpleNamespace(numpy=lambda: logits.astype(np.float32))

    def share_tokens(self, tokens: list[int]) -> list[int]:
        return tokens


def step(n: int, rows: int) -> m.StepRequest:
    spec = lambda i: m.SamplingSpec(i, temperature=0.0, logprobs=True, top_logprobs=20)  # noqa: E731
    return m.StepRequest(n, [m.StepRow(i, [1], 0, [0], [spec(i)]) for i in range(rows)])


async def test_an_unsendable_step_reply_is_counted_and_the_engine_told_at_once(
    small_nats: str,
) -> None:
    state = SimpleNamespace(
        weights=SimpleNamespace(version="", current={}),
        kv=SimpleNamespace(allocated=True, keys=[], values=[], num_blocks=4, block_size=16),
        cfg=SimpleNamespace(vocab_size=VOCAB),
        model=Model(),
    )
    rank_bus = await Bus.connect(small_nats, "rank0")
    engine_bus = await Bus.connect(small_nats, "engine")
    pool = ThreadPoolExecutor(1)
    try:
        stepper = Stepper(state, rank_bus, pool, 0)  # type: ignore[arg-type]
        await rank_bus.subscribe(SUBJECT, stepper.on_step, queue="rank0")
        await rank_bus.flush()
        # a flushed subscription is now and then not yet routed to another connection
        # (two-lane CI: no responders on the first step)
        await settle(engine_bus, rank_bus.nc)
        # a small step answers as usual
        sent = await engine_bus.send(SUBJECT, m.pack(step(1, 2)))
        rep = m.unpack((await sent.reply(10)).data, type=m.StepReply)
        assert not rep.error and len(rep.tokens) == 2 and len(rep.top) == 2
        assert rank_bus.callback_errors == {}
        # 60 rows with 20 alternatives each: the reply is past the server's max_payload
        data = m.pack(step(2, 60))
        assert len(data) < MAX_PAYLOAD
        sent = await engine_bus.send(SUBJECT, data)
        rep = m.unpack((await sent.reply(10)).data, type=m.StepReply)  # not a Timeout
        assert rep.step == 2 and "rank 0: its reply" in rep.error, rep
        assert "could not be sent" in rep.error and "bytes" in rep.error, rep
        assert rank_bus.callback_errors == {SUBJECT: 1}
        # and the rank keeps serving
        sent = await engine_bus.send(SUBJECT, m.pack(step(3, 2)))
        rep = m.unpack((await sent.reply(10)).data, type=m.StepReply)
        assert not rep.error and rank_bus.callback_errors == {SUBJECT: 1}
    finally:
        await engine_bus.close()
        await rank_bus.close()
        pool.shutdown()
        await asyncio.sleep(0)
