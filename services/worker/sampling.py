"""Per-request token sampling over a step's logits (pure numpy, runs on rank 0).

Order of operations per row: ``logit_bias`` (added to the logits, as OpenAI and vLLM do),
then temperature, then top-k, then top-p (nucleus), then a draw
from the renormalised survivors. ``temperature == 0`` means greedy (argmax, lowest id on
ties, as are top_k=1 and a tiny top_p).

Reported logprobs — the sampled token's and the ``top_logprobs`` alternatives — come
from one ``log_softmax(logits + logit_bias)``: the model output with the request's bias
applied (the distribution actually sampled from at temperature 1), before temperature,
top-k and top-p — without a bias, vLLM's default (``logprobs_mode="raw_logprobs"``). So
a token's logprob does not depend on temperature / top-k / top-p; with the RL defaults
(temperature 1, top_p 1, top_k 0) it is exactly the behaviour policy's logprob, and at
another temperature it is the model's, not the tempered sampler's. The alternatives are
the ``top_logprobs`` most likely tokens of that distribution, most likely first, ties
to the lowest id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from shared.messages import MAX_TOP_LOGPROBS

_SEED_MASK = (1 << 64) - 1


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
    """Sample one token per row of `logits` [n, vocab]; returns (token ids, logprobs)."""
    if logits.ndim != 2 or not len(params) == len(generators) == logits.shape[0]:
        raise ValueError("need one SamplingParams and one generator per logits row")
    tokens: list[int] = []
    logprobs: list[float] = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        token, logprob, _ = _sample_row(row.astype(np.float64), p, gen)
        tokens.append(token)
        logprobs.append(logprob)
    return tokens, logprobs


def sample_each(
    logits: np.ndarray, params: list[SamplingParams], generators: list[np.random.Generator]
) -> list[Sampled | Exception]:
    """Like :func:`sample` (with the alternatives when asked), but a row that fails (e.g.
    non-finite logits) yields its exception instead of failing the others."""
    out: list[Sampled | Exception] = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        try:
            out.append(_sample_row(row.astype(np.float64), p, gen))
        except Exception as e:  # noqa: BLE001 - belongs to this row's request only
            out.append(e)
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
    if np.isnan(logits).any():  # a broken row must not turn into a silent random token
        raise ValueError("logits contain NaN")
    if len(p.bias_ids):
        if int(np.max(p.bias_ids)) >= logits.shape[0]:
            raise ValueError(f"logit_bias: token id out of the logits ({logits.shape[0]})")
        logits = logits.copy()  # the caller's row stays as it was
        logits[p.bias_ids] += p.bias_values
    if len(p.ban_ids):
        ban = np.asarray(p.ban_ids, dtype=np.int64)
        if ban.ndim != 1 or (ban < 0).any() or (ban >= logits.shape[0]).any():
            raise ValueError(f"ban: token id out of the logits ({logits.shape[0]})")
        if not len(p.bias_ids):
            logits = logits.copy()
        logits[ban] = -np.inf
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
