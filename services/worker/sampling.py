"""Per-request token sampling over a step's logits (pure numpy, runs on rank 0).

Order of operations per row: ``logit_bias`` (added to the logits, as OpenAI and vLLM do),
the ban (``min_tokens``: -inf), then vLLM's penalties — ``repetition_penalty`` over every
id in the prompt and the output so far (a positive logit divided by it, a negative one
multiplied), then ``frequency_penalty`` times the id's count in the output and
``presence_penalty`` once per id in the output subtracted — then temperature, then
``min_p``, then top-k, then top-p (nucleus), then a draw from the renormalised survivors
(vLLM's order; ``allowed_token_ids`` sets every other id to -inf with the ban).
``temperature == 0`` means greedy (argmax, lowest id on ties, as are top_k=1 and a tiny
top_p). The penalties of all the rows that have one are computed at once (one gather of
every (row, seen id) pair from the step's logits, the formulas over all of them), then
written into each row as it is sampled; rows are still converted to float64 and sampled
one at a time (cache-friendly, no step-sized copy), and a row without a penalty costs
nothing more.

Reported logprobs — the sampled token's and the ``top_logprobs`` alternatives — come
from one ``log_softmax`` of the logits after ``logit_bias``, the ban, the
``allowed_token_ids`` mask and the penalties:
the distribution actually sampled from at temperature 1, before temperature, top-k and
top-p — without a bias or a penalty, vLLM's default (``logprobs_mode="raw_logprobs"``;
with them, vLLM's raw logprobs would be of the unprocessed logits). So
a token's logprob does not depend on temperature / top-k / top-p; with the RL defaults
(temperature 1, top_p 1, top_k 0) it is exactly the behaviour policy's logprob, and at
another temperature it is the model's, not the tempered sampler's. The alternatives are
the ``top_logprobs`` most likely tokens of that distribution, most likely first, ties
to the lowest id.

:class:`TokenHistory` is one sequence's record (prompt then output) on rank 0, kept up
to date incrementally from its step rows, that the penalties read.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from shared.messages import MAX_TOP_LOGPROBS

_SEED_MASK = (1 << 64) - 1
_FLOAT_MAX = float(np.finfo(np.float64).max)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives reported per position (0: none)
    # added to the logits first: bias_values[i] to token bias_ids[i] (no id twice)
    bias_ids: Sequence[int] = ()
    bias_values: Sequence[float] = ()
    ban_ids: Sequence[int] = ()  # never sampled: their logits become -inf (after the bias)
    # vLLM's penalties (off by default), over ``seen_ids``: the sequence's distinct ids so
    # far (prompt and output, no id twice) with ``output_counts``, the times each is in
    # the output (0 for a prompt-only id) — as :meth:`TokenHistory.penalty_view` gives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seen_ids: Sequence[int] | np.ndarray = ()
    output_counts: Sequence[float] | np.ndarray = ()
    # vLLM's: only these ids may be sampled (() = all); after temperature, a token less
    # probable than min_p times the most probable one is dropped (0 = off)
    allowed_ids: Sequence[int] | np.ndarray = ()
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if len(self.bias_ids) != len(self.bias_values):
            raise ValueError("logit_bias: ids and values differ in length")
        if self.bias_ids:
            ids = np.asarray(self.bias_ids, dtype=np.int64)
            values = np.asarray(self.bias_values, dtype=np.float64)
            if ids.ndim != 1 or (ids < 0).any() or len(np.unique(ids)) != len(ids):
                raise ValueError("logit_bias: ids must be distinct token ids")
            if not np.isfinite(values).all():
                raise ValueError("logit_bias: values must be finite")
            self.bias_ids, self.bias_values = ids, values
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if len(self.seen_ids) != len(self.output_counts):
            raise ValueError("penalties: seen_ids and output_counts differ in length")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if len(self.allowed_ids):
            allowed = np.asarray(self.allowed_ids, dtype=np.int64)
            if allowed.ndim != 1 or (allowed < 0).any():
                raise ValueError("allowed_token_ids: must be token ids")
            self.allowed_ids = allowed

    @property
    def prepared(self) -> bool:
        """The row's logits change before the penalties (a bias, a ban, a mask)."""
        return bool(len(self.bias_ids) or len(self.ban_ids) or len(self.allowed_ids))

    @property
    def penalized(self) -> bool:
        """Some penalty changes this row's logits."""
        return len(self.seen_ids) > 0 and (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class Sampled(NamedTuple):
    """One row's result: the token, its logprob and, when asked, the ``top_logprobs``
    most likely ids with their logprobs (float32), most likely first."""

    token: int
    logprob: float
    top: tuple[np.ndarray, np.ndarray] | None = None


def make_generator(seed: int | None, request_salt: int) -> np.random.Generator:
    """One generator per request (or per choice). With a seed the stream depends only on
    (seed, request_salt), so a caller passing a stable salt (e.g. the choice index)
    reproduces outputs across runs while n > 1 choices still differ. Without a seed the
    generator is drawn from OS entropy."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed & _SEED_MASK, request_salt & _SEED_MASK])


def sample(
    logits: np.ndarray, params: list[SamplingParams], generators: list[np.random.Generator]
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [n, vocab]; returns (token ids, logprobs).
    Raises the first row's error, if any."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for res in sample_each(logits, params, generators):
        if isinstance(res, Exception):
            raise res
        tokens.append(res.token)
        logprobs.append(res.logprob)
    return tokens, logprobs


def sample_each(
    logits: np.ndarray, params: list[SamplingParams], generators: list[np.random.Generator]
) -> list[Sampled | Exception]:
    """Like :func:`sample` (with the alternatives when asked), but a row that fails (e.g.
    non-finite logits) yields its exception instead of failing the others."""
    if logits.ndim != 2 or not len(params) == len(generators) == logits.shape[0]:
        raise ValueError("need one SamplingParams and one generator per logits row")
    pen = _penalties(logits, params)  # {} when no row has a penalty
    out: list[Sampled | Exception] = []
    for i, (row, p, gen) in enumerate(zip(logits, params, generators, strict=True)):
        try:
            done = pen.get(i)
            if isinstance(done, Exception):
                raise done
            if done is not None and done.row is not None:
                x = done.row  # prepared already (its bias / ban came before the penalties)
            else:  # one float64 row at a time; the caller's rows stay as they were
                x = row.astype(np.float64)
                _prepare(x, p)
            if done is not None:
                x[done.ids] = done.values
            out.append(_sample_row(x, p, gen))
        except Exception as e:  # noqa: BLE001 - belongs to this row's request only
            out.append(e)
    return out


def _prepare(row: np.ndarray, p: SamplingParams) -> None:
    """``row`` (float64, ours) in place: the bias, then the ban; raises for a bad row."""
    vocab = row.shape[0]
    if np.isnan(row).any():  # a broken row must not turn into a silent random token
        raise ValueError("logits contain NaN")
    if len(p.bias_ids):
        if int(np.max(p.bias_ids)) >= vocab:
            raise ValueError(f"logit_bias: token id out of the logits ({vocab})")
        row[p.bias_ids] += p.bias_values
    if len(p.ban_ids):
        ban = np.asarray(p.ban_ids, dtype=np.int64)
        if ban.ndim != 1 or (ban < 0).any() or (ban >= vocab).any():
            raise ValueError(f"ban: token id out of the logits ({vocab})")
        row[ban] = -np.inf
    if len(p.allowed_ids):  # vLLM's allowed_token_ids: every other id -inf, in place
        allowed = p.allowed_ids
        if int(np.max(allowed)) >= vocab:
            raise ValueError(f"allowed_token_ids: token id out of the logits ({vocab})")
        keep = row[allowed]
        if not np.isfinite(keep).any():
            raise ValueError("no allowed token may be sampled here (all banned: min_tokens)")
        row.fill(-np.inf)
        row[allowed] = keep


class _Penalised(NamedTuple):
    """One row's penalised logits: ``values`` for ``ids``; ``row``: the row itself when
    it had to be prepared first (a bias or a ban on it)."""

    ids: np.ndarray
    values: np.ndarray
    row: np.ndarray | None


def _penalties(
    logits: np.ndarray, params: list[SamplingParams]
) -> dict[int, _Penalised | Exception]:
    """The penalised rows' new logits for their seen ids, by row: one gather from
    ``logits`` over every (row, seen id) pair, the penalties computed on all of them at
    once; only the rows with a bias or a ban are converted here (the penalties apply
    after those), the others stay one row at a time in :func:`sample_each`."""
    vocab = logits.shape[1]
    out: dict[int, _Penalised | Exception] = {}
    which: list[int] = []
    for i, p in enumerate(params):
        if not p.penalized:
            continue
        seen = np.asarray(p.seen_ids)
        if seen.ndim != 1 or int(seen.min()) < 0 or int(seen.max()) >= vocab:
            out[i] = ValueError(f"penalties: token id out of the logits ({vocab})")
            continue
        which.append(i)
    if not which:
        return out
    ps = [params[i] for i in which]
    lens = np.fromiter((len(p.seen_ids) for p in ps), dtype=np.int64, count=len(ps))
    ends = np.cumsum(lens)
    ids = np.concatenate([np.asarray(p.seen_ids, dtype=np.int64) for p in ps])
    counts = np.concatenate([np.asarray(p.output_counts, dtype=np.float64) for p in ps])
    rows = np.repeat(np.asarray(which, dtype=np.int64), lens)
    v = np.ascontiguousarray(logits).reshape(-1)[rows * vocab + ids].astype(np.float64)
    prepared: dict[int, np.ndarray] = {}
    for j, (i, p) in enumerate(zip(which, ps, strict=True)):
        if p.prepared:
            x = logits[i].astype(np.float64)
            try:
                _prepare(x, p)
            except Exception as e:  # noqa: BLE001 - belongs to this row's request only
                out[i] = e
                continue
            prepared[i] = x
            lo = ends[j] - lens[j]
            v[lo : ends[j]] = x[ids[lo : ends[j]]]

    def per_pair(name: str) -> np.ndarray:
        return np.repeat(np.fromiter((getattr(p, name) for p in ps), np.float64, len(ps)), lens)

    rep = per_pair("repetition_penalty")
    with np.errstate(over="ignore", invalid="ignore"):  # a tiny penalty: past float64
        v = np.where(v > 0, np.minimum(v / rep, _FLOAT_MAX), v * rep)
        v -= per_pair("frequency_penalty") * counts + per_pair("presence_penalty") * (counts > 0)
    for j, i in enumerate(which):
        if i not in out:
            lo = ends[j] - lens[j]
            out[i] = _Penalised(ids[lo : ends[j]], v[lo : ends[j]], prepared.get(i))
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def top_logprobs(logp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest entries of ``logp``: (ids, values as float32), largest first,
    ties to the lowest id. O(vocab) for the selection."""
    k = min(k, logp.shape[0])
    kth = -np.partition(-logp, k - 1)[k - 1]
    part = np.flatnonzero(logp >= kth)
    ids = part[np.lexsort((part, -logp[part]))][:k]
    return ids, logp[ids].astype(np.float32)


def _sample_row(logits: np.ndarray, p: SamplingParams, gen: np.random.Generator) -> Sampled:
    """One row already prepared (bias, ban) and penalised."""
    raw = _log_softmax(logits)  # every reported logprob comes from this one
    top = top_logprobs(raw, p.top_logprobs) if p.top_logprobs > 0 else None
    if p.temperature == 0:
        token = int(np.argmax(logits))
        return Sampled(token, float(raw[token]), top)
    if p.temperature == 1:
        logp = raw
    else:
        # Shift first, in float64: a tiny temperature (1e-310) then sends every other
        # logit to -inf and keeps the best at 0 (greedy), never inf - inf = NaN.
        x = logits.astype(np.float64)
        with np.errstate(over="ignore"):
            logp = _log_softmax((x - x.max()) / p.temperature)
    if p.min_p > 0:
        logp = apply_min_p(logp, p.min_p)
    candidates = _truncate(logp, p.top_k, p.top_p)
    if candidates is None:
        probs, ids = np.exp(logp), None
    else:
        probs, ids = np.exp(logp[candidates]), candidates
    cdf = np.cumsum(probs)
    # Inverse-CDF draw: one uniform per token keeps seeded streams easy to reason about.
    pick = min(int(np.searchsorted(cdf, gen.random() * cdf[-1], side="right")), len(cdf) - 1)
    token = pick if ids is None else int(ids[pick])
    return Sampled(token, float(raw[token]), top)


def bad_word_bans(words: Sequence[Sequence[int]], tail: Sequence[int]) -> list[int]:
    """vLLM's ``bad_words`` (``apply_bad_words``) of more than one token: the last id of
    each word whose other ids are the end of the output (``tail``: its last tokens)."""
    bans = []
    for w in words:
        k = len(w) - 1
        if 0 < k <= len(tail) and list(tail[len(tail) - k :]) == list(w[:k]):
            bans.append(w[-1])
    return bans


def apply_min_p(logp: np.ndarray, min_p: float) -> np.ndarray:
    """vLLM's min_p over tempered log-probabilities: a token whose probability is below
    ``min_p`` times the most probable one's gets -inf (a new array; the most probable
    tokens always stay). vLLM applies it after temperature, before top-k / top-p."""
    return np.where(logp >= logp.max() + math.log(min_p), logp, -np.inf)


def _truncate(logp: np.ndarray, top_k: int, top_p: float) -> np.ndarray | None:
    """Ids surviving top-k then top-p, most probable first; None when nothing is cut."""
    vocab = logp.shape[0]
    if (top_k == 0 or top_k >= vocab) and top_p >= 1.0:
        return None
    if 0 < top_k < vocab:
        # partition keeps this O(vocab); ties at the k-th value resolve to the lowest ids.
        kth = -np.partition(-logp, top_k - 1)[top_k - 1]
        part = np.flatnonzero(logp >= kth)
        ids = part[np.lexsort((part, -logp[part]))][:top_k]
    else:
        ids = np.lexsort((np.arange(vocab), -logp))
    if top_p < 1.0:
        probs = np.exp(logp[ids])
        cum = np.cumsum(probs / probs.sum())
        # Smallest prefix whose mass reaches top_p; always at least the top token.
        keep = int(np.searchsorted(cum, top_p, side="left")) + 1
        ids = ids[: min(keep, len(ids))]
    return ids


class TokenHistory:
    """One sequence's tokens, position by position (prompt then output), as its step rows
    bring them to rank 0, and what the penalties read from them: the distinct ids so far
    and how often each is in the output. Kept up to date incrementally — a decode step
    adds one token in O(1) — and rebuilt (numpy) only when positions are rewritten
    (recompute after a preemption) or the prompt length changes.

    ``lost``: positions were skipped (a row began past the end of the record, e.g. rank 0
    restarted mid-sequence): what it holds is not the sequence, so it must not be used
    until a row starting at position 0 rebuilds it."""

    _REBUILD = 64  # more new positions than this at once: a numpy rebuild, not a loop

    def __init__(self) -> None:
        self.tokens = array.array("i")  # int32: token ids are < 2**31
        self.lost = False
        self._split = -1  # the prompt length the counts are split at (-1: none yet)
        self._folded = 0  # positions folded into the ids / counts below
        self._slot: dict[int, int] = {}  # id -> its index in _ids / _counts
        self._ids = np.zeros(16, np.int64)
        self._counts = np.zeros(16, np.float64)

    def __len__(self) -> int:
        return len(self.tokens)

    def record(self, start: int, tokens: Sequence[int]) -> None:
        """``tokens`` are positions ``start``, ``start + 1``, ... of the sequence."""
        if start > len(self.tokens):
            self.lost = True
            return
        if start == 0:
            self.lost = False
        if start < len(self.tokens):
            del self.tokens[start:]
            if start < self._folded:
                self._split = -1  # positions the counts were made of changed: rebuild
        self.tokens.extend(tokens)

    def copy(self) -> TokenHistory:
        other = TokenHistory()
        other.tokens = array.array("i", self.tokens)
        other.lost = self.lost
        return other

    def penalty_view(self, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(distinct ids so far, the times each is at a position >= ``prompt_len``): views
        valid until the next :meth:`record`."""
        n = len(self.tokens)
        if self._split != prompt_len or self._folded > n or n - self._folded > self._REBUILD:
            self._rebuild(prompt_len)
        for pos in range(self._folded, n):
            tok = self.tokens[pos]
            slot = self._slot.get(tok)
            if slot is None:
                slot = self._slot[tok] = len(self._slot)
                if slot == len(self._ids):
                    self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                self._ids[slot] = tok
            if pos >= prompt_len:
                self._counts[slot] += 1
        self._folded = n
        k = len(self._slot)
        return self._ids[:k], self._counts[:k]

    def _rebuild(self, prompt_len: int) -> None:
        arr = np.frombuffer(self.tokens, dtype=np.int32) if self.tokens else np.zeros(0, np.int32)
        ids, inverse = np.unique(arr, return_inverse=True)
        counts = np.bincount(inverse[prompt_len:], minlength=len(ids)).astype(np.float64)
        cap = max(16, 2 * len(ids))
        self._ids = np.zeros(cap, np.int64)
        self._counts = np.zeros(cap, np.float64)
        self._ids[: len(ids)] = ids
        self._counts[: len(ids)] = counts
        self._slot = dict(zip(ids.tolist(), range(len(ids)), strict=True))
        self._split, self._folded = prompt_len, len(arr)
