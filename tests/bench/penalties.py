"""What the penalties cost rank 0 per decode step: ``python -m tests.bench.penalties``.

Runs rank 0's real step code (:class:`Stepper`: the rows' token record, the sample specs,
:func:`sample_each`) on a stand-in model that returns fixed logits ``[batch, vocab]``
(the forward pass is the same with or without penalties, so it is left out), for a
batch of decoding sequences each with a ``--prompt`` + ``--output`` token record. Three
variants, interleaved round by round (the shared-machine method): no penalties, all
rows penalised (repetition + presence + frequency), and half the rows penalised. Prints
rank 0's CPU seconds per step (``time.process_time``, robust to other load) and the
extra per step over no penalties — on a busy machine that difference is within the noise
of the sampling itself, so the penalty path alone (record one token, the ids / counts
view, the batched gather and formulas, the write into each row: what the penalties add)
is timed separately too.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from services.worker.sampling import SamplingParams, TokenHistory, _penalties
from services.worker.stepper import Stepper
from shared import messages as m


class Fixed:
    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def forward(self, weights: Any, kv: Any, batch: Any) -> Any:
        return SimpleNamespace(numpy=lambda: self.logits[: len(batch.token_ids)])

    def share_tokens(self, tokens: list[int]) -> list[int]:
        return tokens


def rank(logits: np.ndarray) -> Stepper:
    state = SimpleNamespace(
        weights=SimpleNamespace(version="v0", current={}),
        kv=SimpleNamespace(allocated=True, keys=[], values=[]),
        model=Fixed(logits),
    )
    return Stepper(state, None, None, 0)  # type: ignore[arg-type]


def run(args: argparse.Namespace, share: float, rng: np.random.Generator, logits: np.ndarray):
    """CPU seconds per decode step with ``share`` of the rows penalised."""
    st = rank(logits)
    pen = m.Penalties(0.5, 0.3, 1.2, args.prompt)
    hist = [rng.integers(0, args.vocab, args.prompt + args.output).tolist()
            for _ in range(args.batch)]  # fmt: skip
    penalised = [i < share * args.batch for i in range(args.batch)]
    # prefill the records (untimed): one row per sequence with everything so far
    st.run(m.StepRequest(1, [
        m.StepRow(i, h, 0, [0], [], history=penalised[i]) for i, h in enumerate(hist)
    ]))  # fmt: skip
    t0 = time.process_time()
    for step in range(args.steps):
        pos = args.prompt + args.output + step
        rows = [
            m.StepRow(i, [int(rng.integers(args.vocab))], pos, [0], [m.SamplingSpec(
                i, temperature=1.0, seed=i, penalties=pen if penalised[i] else None,
            )], history=penalised[i])
            for i in range(args.batch)
        ]  # fmt: skip
        reply = st.run(m.StepRequest(step + 2, rows))
        assert not reply.failed and len(reply.tokens) == args.batch, reply.failed
    return (time.process_time() - t0) / args.steps


def penalty_path(args: argparse.Namespace, rng: np.random.Generator, logits: np.ndarray):
    """CPU seconds per step of the penalty work alone, every row penalised."""
    x = logits.astype(np.float64)
    hs = []
    for _ in range(args.batch):
        h = TokenHistory()
        h.record(0, rng.integers(0, args.vocab, args.prompt + args.output).tolist())
        h.penalty_view(args.prompt)
        hs.append(h)
    steps = args.steps * 10
    t0 = time.process_time()
    for _ in range(steps):
        ps = []
        for h in hs:
            h.record(len(h), [int(rng.integers(args.vocab))])
            seen, counts = h.penalty_view(args.prompt)
            ps.append(SamplingParams(repetition_penalty=1.2, presence_penalty=0.5,
                                     frequency_penalty=0.3, seen_ids=seen,
                                     output_counts=counts))  # fmt: skip
        for i, done in _penalties(logits, ps).items():
            assert not isinstance(done, Exception)
            x[i][done.ids] = done.values
    distinct = sum(len(h.penalty_view(args.prompt)[0]) for h in hs)
    return (time.process_time() - t0) / steps, distinct


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)  # Qwen2.5 / Qwen3
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (args.batch, args.vocab)).astype(np.float32)
    variants = {"none": 0.0, "all rows": 1.0, "half the rows": 0.5}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.runs):
        for name, share in variants.items():
            times[name].append(run(args, share, rng, logits))
    alone = [penalty_path(args, rng, logits) for _ in range(args.runs)]
    base = float(np.median(times["none"]))
    print(f"rank 0 host work per decode step: batch {args.batch}, vocab {args.vocab}, "
          f"record {args.prompt} prompt + {args.output}.. output tokens, "
          f"median of {args.runs} runs x {args.steps} steps (CPU s)")  # fmt: skip
    for name, ts in times.items():
        t = float(np.median(ts))
        print(f"  penalties on {name:14s} {t * 1e3:8.2f} ms/step   "
              f"+{(t - base) * 1e3:6.2f} ms ({t / base:.2f}x)")  # fmt: skip
    t = float(np.median([a for a, _ in alone]))
    print(f"  the penalty path alone, all rows: {t * 1e3:.2f} ms/step "
          f"({alone[0][1]} (row, id) pairs gathered and scattered)")  # fmt: skip


if __name__ == "__main__":
    main()
