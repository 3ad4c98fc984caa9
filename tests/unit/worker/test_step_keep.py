"""A rank's side of pipelined steps: a step with ``keep`` leaves its sampled tokens for
the next step's ``prev`` rows; nothing older is ever used."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from services.worker.stepper import Stepper
from shared import messages as m

VOCAB = 16


class Model:
    """Greedy picks (last input token + 1) % VOCAB; records what each row was fed."""

    def __init__(self) -> None:
        self.fed: list[list[list[int]]] = []
        self.shared: list[list[int]] = []

    def forward(self, weights: Any, kv: Any, batch: Any) -> Any:
        self.fed.append(batch.token_ids)
        logits = np.zeros((len(batch.token_ids), VOCAB), np.float32)
        for i, toks in enumerate(batch.token_ids):
            logits[i, (toks[-1] + 1) % VOCAB] = 10.0
        return SimpleNamespace(numpy=lambda: logits)

    def share_tokens(self, tokens: list[int]) -> list[int]:
        self.shared.append(tokens)
        return tokens


def stepper() -> tuple[Stepper, Model]:
    model = Model()
    state = SimpleNamespace(
        weights=SimpleNamespace(version="v0", current={}),
        kv=SimpleNamespace(allocated=True, keys=[], values=[]),
        model=model,
    )
    return Stepper(state, None, None, 0), model  # type: ignore[arg-type]


def row(seq: int, toks: list[int], pos: int, prev: bool = False, temp: float = 0.0) -> m.StepRow:
    return m.StepRow(seq, toks, pos, [0], [m.SamplingSpec(seq, temperature=temp)], prev)


def test_prev_rows_continue_with_the_token_kept_from_the_step_before() -> None:
    st, model = stepper()
    r1 = st.run(m.StepRequest(1, [row(0, [3, 4], 0), row(1, [9], 0)], keep=True))
    assert r1.tokens == [5, 10] and model.shared == [[5, 10]]
    r2 = st.run(m.StepRequest(2, [row(0, [], 2, prev=True), row(1, [], 1, prev=True)], keep=True))
    assert model.fed[-1] == [[5], [10]] and r2.tokens == [6, 11]
    # a step without keep leaves nothing: a prev row after it is refused, on every rank
    st.run(m.StepRequest(3, [row(0, [6], 3)]))
    with pytest.raises(RuntimeError, match="did not keep"):
        st.run(m.StepRequest(4, [row(0, [], 4, prev=True)], keep=True))
    # nor does a step that is not the one just before (a step refused in between)
    st.run(m.StepRequest(5, [row(0, [6], 3)], keep=True))
    with pytest.raises(RuntimeError, match="did not keep"):
        st.run(m.StepRequest(7, [row(0, [], 4, prev=True)], keep=True))


def test_a_failed_sample_is_kept_as_a_placeholder_the_engine_drops() -> None:
    st, model = stepper()
    bad = row(1, [2], 0, temp=-1.0)  # bad sampling parameters: this sequence fails alone
    r1 = st.run(m.StepRequest(1, [row(0, [1], 0), bad], keep=True))
    assert r1.seq_ids == [0] and [f[0] for f in r1.failed] == [1]
    assert model.shared == [[2, -1]]
    st.run(m.StepRequest(2, [row(0, [], 1, prev=True), row(1, [], 1, prev=True)], keep=True))
    assert model.fed[-1] == [[2], [0]]


class Bus:
    def __init__(self) -> None:
        self.replies: list[m.StepReply] = []

    async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
        self.replies.append(m.unpack(data, type=m.StepReply))


async def test_a_step_handler_returns_once_queued_and_replies_in_order() -> None:
    """The next step is read while one computes (at most 2 taken), replies in order."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from services.worker.stepcheck import StepLimits

    gate = threading.Event()
    st, model = stepper()
    forward = model.forward

    def slow(*args: Any) -> Any:
        gate.wait(10)
        return forward(*args)

    model.forward = slow  # type: ignore[method-assign]
    bus = Bus()
    pool = ThreadPoolExecutor(max_workers=1)
    st.bus, st.pool = bus, pool  # type: ignore[assignment]
    st.__dict__["limits"] = StepLimits(VOCAB, 4, 16, 64)

    def msg(step: int) -> Any:
        req = m.StepRequest(step, [row(0, [1], step - 1)], keep=True)
        return SimpleNamespace(data=m.pack(req), reply="inbox", headers={})

    try:
        await st.on_step(msg(1))
        await st.on_step(msg(2))  # returned although step 1 still computes
        assert st.watermark.job == "step 1" and not bus.replies
        third = asyncio.ensure_future(st.on_step(msg(3)))
        await asyncio.sleep(0.05)
        assert not third.done()  # a third waits until one of the two is answered
        gate.set()
        await asyncio.wait_for(third, 10)
        for _ in range(500):
            if len(bus.replies) == 3:
                break
            await asyncio.sleep(0.01)
        assert [r.step for r in bus.replies] == [1, 2, 3]
        assert not any(r.error for r in bus.replies)
    finally:
        gate.set()
        pool.shutdown(wait=True)
