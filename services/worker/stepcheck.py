"""Checks of a ``worker.step`` message before any rank computes it. Pure.

The step subject is reachable over raw NATS: a malformed or out-of-range message must
get an error reply, never reach paddle (an out-of-range token id or block index would
crash or corrupt a rank). Every rank runs the same check on the same message, so they
all refuse it together and none waits alone in a collective.

Sampling parameters are checked per sequence on rank 0 (``sampling.check_spec``): a bad
one fails only its own request.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared import messages as m


@dataclass(frozen=True)
class StepLimits:
    vocab_size: int
    num_blocks: int
    block_size: int
    max_model_len: int
    max_rows: int = 4096
    max_samples: int = 1 << 16


def check_step(req: m.StepRequest, lim: StepLimits) -> str | None:
    """Why ``req`` must not run (None when it may)."""
    if len(req.rows) > lim.max_rows:
        return f"{len(req.rows)} rows; the limit is {lim.max_rows}"
    for src, dst in req.copies:
        if not (0 <= src < lim.num_blocks and 0 <= dst < lim.num_blocks):
            return f"block copy {src}->{dst} outside 0..{lim.num_blocks - 1}"
    iters = req.iters
    if not 1 <= iters <= m.MAX_STEP_ITERS:
        return f"iters {iters} outside 1..{m.MAX_STEP_ITERS}"
    more = iters - 1  # positions the later iterations add after a row's new tokens
    samples = 0
    seen: set[int] = set()
    # min/max over a row's ids, and its message named only once it fails: checked on
    # every rank's event loop for every step, so in as few Python steps as it takes
    for i, row in enumerate(req.rows):
        ids, table = row.token_ids, row.block_table
        new = len(ids) + row.prev
        end = row.start_pos + new + more
        if (
            not new
            or row.seq_id in seen
            or (ids and (min(ids) < 0 or max(ids) >= lim.vocab_size))
            or row.start_pos < 0
            or end > lim.max_model_len
            or len(table) * lim.block_size < end
            or (table and (min(table) < 0 or max(table) >= lim.num_blocks))
        ):
            return _bad_row(i, row, seen, lim, iters)
        if more and not _one_decode_spec(row):
            return (
                f"row {i} (seq {row.seq_id}): iters {iters} needs one sample spec of its own "
                "sequence, without bad_words (their tail changes with every token)"
            )
        seen.add(row.seq_id)
        samples += len(row.sample)
    if samples > lim.max_samples:
        return f"{samples} sampled sequences; the limit is {lim.max_samples}"
    return None


def _one_decode_spec(row: m.StepRow) -> bool:
    """``row`` may run several iterations: one spec, its own, the same at every token."""
    if len(row.sample) != 1:
        return False
    spec = row.sample[0]
    return spec.seq_id == row.seq_id and not (spec.limits and spec.limits.bad_words)


def _bad_row(i: int, row: m.StepRow, seen: set[int], lim: StepLimits, iters: int) -> str:
    """Why row ``i`` fails :func:`check_step` (``seen``: the sequences of the rows before;
    ``iters``: the step's iterations, whose positions the row's block table must hold)."""
    where = f"row {i} (seq {row.seq_id})"
    if not row.num_new:
        return f"{where}: no tokens"
    if row.seq_id in seen:
        return f"{where}: sequence twice in one step"
    if any(not 0 <= t < lim.vocab_size for t in row.token_ids):
        return f"{where}: token id outside 0..{lim.vocab_size - 1}"
    end = row.start_pos + row.num_new + iters - 1
    if row.start_pos < 0 or end > lim.max_model_len:
        return f"{where}: positions {row.start_pos}..{end} outside 0..{lim.max_model_len}"
    if len(row.block_table) * lim.block_size < end:
        return f"{where}: {len(row.block_table)} blocks cannot hold {end} positions"
    return f"{where}: block id outside 0..{lim.num_blocks - 1}"
