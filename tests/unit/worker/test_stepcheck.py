"""The ranks' check of a ``worker.step`` message (reachable over raw NATS)."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.sampling import SamplingParams, make_generator, sample_each
from services.worker.stepcheck import StepLimits, check_step
from shared import messages as m

LIM = StepLimits(vocab_size=320, num_blocks=16, block_size=4, max_model_len=64)


def step(**row: object) -> m.StepRequest:
    fields: dict[str, object] = {
        "seq_id": 0,
        "token_ids": [1, 2, 3],
        "start_pos": 0,
        "block_table": [0],
        "sample": [],
    }
    fields.update(row)
    return m.StepRequest(1, [m.StepRow(**fields)])  # type: ignore[arg-type]


def test_a_well_formed_step_passes() -> None:
    assert check_step(step(), LIM) is None


@pytest.mark.parametrize(
    "bad",
    [
        step(token_ids=[]),
        step(token_ids=[1, 320]),
        step(token_ids=[-1]),
        step(start_pos=-1),
        step(start_pos=62),  # past max_model_len
        step(block_table=[]),  # cannot hold the positions
        step(block_table=[16]),
        step(block_table=[-1]),
        m.StepRequest(1, [], copies=[(0, 16)]),
        m.StepRequest(1, [step().rows[0], step().rows[0]]),  # one sequence twice
        m.StepRequest(1, step().rows * 5000),
    ],
)
def test_malformed_steps_are_refused(bad: m.StepRequest) -> None:
    assert check_step(bad, LIM)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": float("nan")},
        {"top_k": -1},
        {"seed": 2**64},
    ],
)
def test_bad_sampling_parameters_raise(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_a_failing_row_does_not_fail_the_others() -> None:
    logits = np.zeros((2, 8))
    logits[1, :] = np.nan
    out = sample_each(
        logits,
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
        [make_generator(1, 0), make_generator(1, 1)],
    )
    assert out[0][:2] == (0, pytest.approx(np.log(1 / 8)))
    assert isinstance(out[1], ValueError)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (step(token_ids=[]), "no tokens"),
        (step(token_ids=[1, 320]), "token id outside 0..319"),
        (step(token_ids=[-1]), "token id outside"),
        (step(start_pos=-1), "positions -1..2 outside"),
        (step(start_pos=62), "positions 62..65 outside"),
        (step(block_table=[]), "0 blocks cannot hold"),
        (step(block_table=[16]), "block id outside 0..15"),
        (step(block_table=[-1]), "block id outside"),
        (m.StepRequest(1, [step().rows[0], step().rows[0]]), "row 1 (seq 0): sequence twice"),
    ],
)
def test_a_refused_row_is_named_with_its_own_reason(bad: m.StepRequest, why: str) -> None:
    # the rows are checked in one pass and the reason found only for the one that failed
    assert why in (check_step(bad, LIM) or "")


def _rows(*rows: m.StepRow) -> m.StepRequest:
    return m.StepRequest(1, list(rows))


def _row(seq: int = 0, ids: list[int] | None = None, pos: int = 0, **kw: object) -> m.StepRow:
    table = kw.pop("table", list(range(16)))
    return m.StepRow(seq, [1] if ids is None else ids, pos, table, [], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("req", "why"),
    [
        # the edges that pass: a row's ``prev`` token alone, ids 0 and vocab - 1, the
        # last position and block, no rows at all (finished ids / copies only)
        (_rows(_row(ids=[], prev=True)), None),
        (_rows(_row(ids=[0, 319], pos=62)), None),
        (_rows(_row(ids=[1], table=[15])), None),
        (_rows(), None),
        (_rows(_row(0), _row(1, ids=[], pos=63, prev=True)), None),
        # ``prev`` counts: one more position than the ids
        (_rows(_row(ids=[1], pos=63, prev=True)), "row 0 (seq 0): positions 63..65 outside"),
        (_rows(_row(ids=[1, 2, 3, 4], table=[0], prev=True)), "1 blocks cannot hold 5"),
        # the first failing row is the one named, after rows that pass
        (_rows(_row(0), _row(1, ids=[2**40])), "row 1 (seq 1): token id outside"),
        (_rows(_row(0), _row(1), _row(0)), "row 2 (seq 0): sequence twice"),
        (_rows(_row(0), _row(1, table=[0, -5])), "row 1 (seq 1): block id outside"),
        (_rows(_row(0, ids=[], prev=False)), "row 0 (seq 0): no tokens"),
    ],
)
def test_the_one_pass_check_keeps_each_edge(req: m.StepRequest, why: str | None) -> None:
    # as before the one-pass check: the same rows pass, the same row is named
    got = check_step(m.unpack(m.pack(req), type=m.StepRequest), LIM)
    assert got == why if why is None else why in (got or "")
