"""``repetition_penalty``, ``presence_penalty`` and ``frequency_penalty`` with vLLM's
semantics, against the documented formulas written out densely here (transformers'
``RepetitionPenaltyLogitsProcessor`` itself is the reference in tests/compat):

- repetition (transformers / vLLM): every id in the prompt or the output so far has its
  logit divided by the penalty when positive, multiplied when negative;
- presence / frequency (OpenAI): ``logit -= frequency * count + presence * (count > 0)``,
  ``count`` the id's occurrences in the output only;

applied after ``logit_bias`` and the ``min_tokens`` ban, before temperature / top-k /
top-p, the reported logprobs being those of the penalised distribution. Then the rank's
record of each sequence (:class:`TokenHistory`) through rows, forks, recompute and a lost
record, and the scheduler's rows on a whole engine loop (scheduler + rank, bigram model).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from services.engine.scheduler import Scheduler
from services.worker.sampling import SamplingParams, TokenHistory, sample, sample_each
from services.worker.stepper import Stepper
from shared import messages as m
from shared.errors import BAD_REQUEST, INTERNAL
from tests.unit.worker.test_sampling import gens, log_softmax


def reference(
    x: np.ndarray,
    prompt: list[int],
    output: list[int],
    rep: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> np.ndarray:
    """One row through the formulas, dense over the vocabulary."""
    y = x.astype(np.float64).copy()
    seen = np.zeros(len(y), bool)
    seen[prompt + output] = True
    y = np.where(seen, np.where(y > 0, y / rep, y * rep), y)
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(y))
    return y - (counts * frequency + (counts > 0) * presence)


def view(prompt: list[int], output: list[int]) -> tuple[np.ndarray, np.ndarray]:
    h = TokenHistory()
    h.record(0, prompt + output)
    return h.penalty_view(len(prompt))


def params(prompt: list[int], output: list[int], **kw: Any) -> SamplingParams:
    seen, counts = view(prompt, output)
    return SamplingParams(seen_ids=seen, output_counts=counts, **kw)


CASES = [  # (repetition, presence, frequency)
    (1.8, 0.0, 0.0),
    (0.7, 0.0, 0.0),  # < 1 favours repeats
    (1.0, 1.5, 0.0),
    (1.0, 0.0, 1.2),
    (1.0, -1.5, -0.4),  # negative: repeats favoured
    (2.0, 2.0, 2.0),
    (1.0, 0.0, 0.0),  # off
]


def test_greedy_logprobs_and_top_logprobs_follow_the_formulas() -> None:
    rng = np.random.default_rng(3)
    vocab = 300
    x = rng.normal(0, 3, (len(CASES), vocab)).astype(np.float32)
    rows = []
    for i, (rep, pres, freq) in enumerate(CASES):
        prompt = rng.integers(0, vocab, 12).tolist()
        # the output repeats the row's top tokens, several times each
        top = np.argsort(-x[i])[:6].tolist()
        output = [top[j % 3] for j in range(7)] + rng.integers(0, vocab, 5).tolist()
        p = params(prompt, output, temperature=0, top_logprobs=5, repetition_penalty=rep,
                   presence_penalty=pres, frequency_penalty=freq)  # fmt: skip
        rows.append((p, reference(x[i], prompt, output, rep, pres, freq)))
    res = sample_each(x, [p for p, _ in rows], gens(len(rows)))
    for i, ((_, want), got) in enumerate(zip(rows, res, strict=True)):
        assert not isinstance(got, Exception), got
        lp = log_softmax(want[None])[0]
        assert got.token == int(np.argmax(want)), CASES[i]
        assert got.logprob == pytest.approx(lp[got.token], abs=1e-9)
        assert got.top is not None
        assert got.top[0].tolist() == np.argsort(-lp, kind="stable")[:5].tolist()
        np.testing.assert_allclose(got.top[1], lp[got.top[0]], atol=1e-6)
    # the greedy choice did change where the penalty hits the top tokens
    changed = [r.token != int(np.argmax(x[i])) for i, r in enumerate(res)]  # type: ignore[union-attr]
    assert sum(changed[:6]) >= 3 and not changed[6], changed


@pytest.mark.parametrize("kw", [{"temperature": 0.8}, {"top_k": 5, "top_p": 0.9}])
def test_draws_are_those_of_the_penalised_distribution(kw: dict[str, float]) -> None:
    """A seeded draw with penalties is the same draw as without them on the reference's
    penalised logits: temperature / top-k / top-p come after the penalties."""
    rng = np.random.default_rng(5)
    x = rng.normal(0, 2, (1, 80)).astype(np.float32)
    prompt, output = [1, 2, 3], [int(np.argmax(x[0])), 7, 7, 7, 9]
    pen = {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    ours = params(prompt, output, seed=4, **pen, **kw)
    plain = SamplingParams(seed=4, **kw)
    want = reference(x[0], prompt, output, 1.5, 0.5, 0.3)[None]
    for seed in range(20):
        a = sample_each(x, [ours], gens(1, seed))[0]
        b = sample_each(want, [plain], gens(1, seed))[0]
        assert not isinstance(a, Exception) and not isinstance(b, Exception)
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-9)


def test_the_penalties_come_after_logit_bias_and_the_ban() -> None:
    x = np.zeros((1, 8), np.float32)
    x[0] = [-1.0, 0.5, 0.2, 0.1, 0, 0, 0, 3.0]
    # bias first: (-1 + 3) / 4 = 0.5 for token 0; the other order would give -4 + 3 = -1
    p = params([0], [], temperature=0, repetition_penalty=4.0, bias_ids=[0, 7],
               bias_values=[3.0, -10.0], top_logprobs=2)  # fmt: skip
    (res,) = sample_each(x, [p], gens(1))
    assert not isinstance(res, Exception) and res.top is not None
    assert res.top[0].tolist() == [0, 1]  # 0.5 ties token 1 at 0.5: the lower id first
    # a banned id stays banned whatever a negative penalty adds back
    q = params([], [7, 7, 7], temperature=1.0, seed=1, ban_ids=[7], presence_penalty=-2.0,
               frequency_penalty=-2.0)  # fmt: skip
    assert 7 not in {sample(x, [q], [g])[0][0] for g in gens(50, 1)}


def test_an_extreme_penalty_never_yields_nan() -> None:
    x = np.array([[2.0, -1.0, 1.0, 0.0]], np.float32)
    tiny = params([2], [2, 2], temperature=0, repetition_penalty=1e-300, logprobs=True)
    (res,) = sample_each(x, [tiny], gens(1))
    assert not isinstance(res, Exception) and res.token == 2 and np.isfinite(res.logprob)
    huge = params([0], [], temperature=1.0, seed=1, repetition_penalty=1e300)
    toks, lps = sample(x, [huge], gens(1))
    assert toks[0] != 0 or np.isfinite(lps[0])


@pytest.mark.parametrize(
    "kw",
    [{"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                                 "top_logprobs": 4}],
)  # fmt: skip
def test_off_is_bit_for_bit_no_penalty_and_other_rows_are_untouched(kw: dict[str, Any]) -> None:
    rng = np.random.default_rng(9)
    x = rng.normal(0, 3, (6, 500)).astype(np.float32)
    plain = sample_each(x, [SamplingParams(seed=9, **kw)] * 6, gens(6, 9))
    off = params([1, 2, 3], [4, 4], seed=9, **kw)  # a record, every penalty at its default
    again = sample_each(x, [off] * 6, gens(6, 9))
    hit = params([1], [int(np.argmax(x[0]))] * 3, seed=9, repetition_penalty=3.0, **kw)
    before = x.copy()
    mixed = sample_each(x, [hit] + [off] * 5, gens(6, 9))  # row 0 penalised, the others not
    assert x.tobytes() == before.tobytes()  # the caller's logits stay as they were
    for i, (a, b, c) in enumerate(zip(plain, again, mixed, strict=True)):
        assert not isinstance(a, Exception) and not isinstance(b, Exception)
        assert (a.token, a.logprob) == (b.token, b.logprob)
        if i:
            assert not isinstance(c, Exception) and (c.token, c.logprob) == (a.token, a.logprob)


@pytest.mark.parametrize(
    "kw",
    [
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"presence_penalty": float("nan")},
        {"frequency_penalty": float("inf")},
        {"seen_ids": [1, 2], "output_counts": [1.0]},
    ],
)
def test_bad_penalties_rejected(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="penalt|seen_ids"):
        SamplingParams(**kw)


def test_an_id_beyond_the_logits_fails_its_row_only() -> None:
    x = np.zeros((2, 8), np.float32)
    bad = SamplingParams(repetition_penalty=2.0, seen_ids=[8], output_counts=[1.0])
    res = sample_each(x, [bad, SamplingParams(temperature=0)], gens(2))
    assert isinstance(res[0], ValueError) and "penalties" in str(res[0])
    assert not isinstance(res[1], Exception)


# --------------------------------------------------------------------------- the record


def dense(tokens: list[int], prompt_len: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    seen = np.zeros(vocab, bool)
    seen[tokens] = True
    counts = np.bincount(np.asarray(tokens[prompt_len:], dtype=np.int64), minlength=vocab)
    return seen, counts


def test_the_record_follows_rows_rewrites_and_prompt_lengths() -> None:
    rng = np.random.default_rng(1)
    vocab = 50
    h, truth = TokenHistory(), []
    for step in range(400):
        kind = rng.random()
        if kind < 0.7 or not truth:  # decode: one more position (most steps)
            start, new = len(truth), [int(rng.integers(vocab))]
        elif kind < 0.8:  # a big chunk (prefill): the numpy rebuild
            start, new = len(truth), rng.integers(0, vocab, 100).tolist()
        elif kind < 0.95:  # positions written again (a step re-run, recompute)
            start = int(rng.integers(0, len(truth) + 1))
            new = rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
        else:  # recompute after a preemption: all of it again from 0
            start, new = 0, truth[: int(rng.integers(1, len(truth) + 1))]
        h.record(start, new)
        truth = truth[:start] + new
        assert list(h.tokens) == truth and not h.lost
        prompt_len = min(len(truth), 10 if step < 200 else 3)
        ids, counts = h.penalty_view(prompt_len)
        seen, want = dense(truth, prompt_len, vocab)
        assert len(set(ids.tolist())) == len(ids), "an id twice"
        assert sorted(ids.tolist()) == np.flatnonzero(seen).tolist()
        np.testing.assert_array_equal(counts, want[ids])


def test_a_gap_is_lost_until_a_row_from_zero() -> None:
    h = TokenHistory()
    h.record(0, [1, 2])
    h.record(5, [3])  # positions 2..4 never seen
    assert h.lost
    h.record(0, [4, 5, 6])
    assert not h.lost and list(h.tokens) == [4, 5, 6]
    c = h.copy()
    c.record(3, [7])
    assert list(h.tokens) == [4, 5, 6] and list(c.tokens) == [4, 5, 6, 7]


# --------------------------------------------------------------------------- the rank

VOCAB = 16
TABLE = np.random.default_rng(0).normal(0, 2, (VOCAB, VOCAB)).astype(np.float32)


class Bigram:
    """Logits of the row's last token's row of ``TABLE``; a greedy walk cycles soon."""

    def forward(self, weights: Any, kv: Any, batch: Any) -> Any:
        logits = np.stack([TABLE[toks[-1]] for toks in batch.token_ids])
        return SimpleNamespace(numpy=lambda: logits)

    def share_tokens(self, tokens: list[int]) -> list[int]:
        return tokens


def rank() -> Stepper:
    state = SimpleNamespace(
        weights=SimpleNamespace(version="v0", current={}),
        kv=SimpleNamespace(allocated=True, keys=[], values=[]),
        model=Bigram(),
    )
    return Stepper(state, None, None, 0)  # type: ignore[arg-type]


def walk(prompt: list[int], n: int, rep: float = 1.0, pres: float = 0.0, freq: float = 0.0):
    """The greedy reference: the formulas over the bigram model, token by token."""
    out: list[int] = []
    for _ in range(n):
        seq = prompt + out
        out.append(int(np.argmax(reference(TABLE[seq[-1]], prompt, out, rep, pres, freq))))
    return out


def engine_loop(
    gens_: list[m.GenRequest], num_blocks: int = 64, preempted: bool = False
) -> dict[str, list[list[int]]]:
    """Scheduler and rank, step after step (rows, forks, preemption: all real)."""
    s = Scheduler(num_blocks, 4, 8, 64, max_model_len=64)
    st = rank()
    reqs = [s.add(g, "inbox") for g in gens_]
    for _ in range(500):
        plan = s.schedule()
        if plan is None:
            break
        reply = st.run(plan.step)
        assert not reply.error and not reply.failed, (reply.error, reply.failed)
        s.apply(plan, reply, "v0")
    assert not s.requests and (s.preemptions > 0) == preempted
    return {r.gen.request_id: [q.output for q in r.seqs] for r in reqs}


def test_engine_and_rank_give_the_reference_walk() -> None:
    prompt = [3, 1, 4, 1, 5]
    plain = walk(prompt, 20)
    assert len(set(plain)) < 10  # the model does repeat itself
    gens_ = [
        m.GenRequest("plain", prompt, 20, temperature=0),
        m.GenRequest("rep", prompt, 20, n=2, temperature=0, repetition_penalty=3.0),
        m.GenRequest("freq", prompt, 20, temperature=0, frequency_penalty=1.0,
                     presence_penalty=0.5),  # fmt: skip
        m.GenRequest("neg", prompt, 20, temperature=0, presence_penalty=-2.0),
    ]
    want = {
        "plain": [plain],
        "rep": [walk(prompt, 20, rep=3.0)] * 2,  # both choices: one forked from the prompt
        "freq": [walk(prompt, 20, pres=0.5, freq=1.0)],
        "neg": [walk(prompt, 20, pres=-2.0)],
    }
    assert want["rep"][0] != plain and want["freq"][0] != plain
    assert engine_loop(gens_) == want
    # few KV blocks: sequences are preempted and recomputed (their rows start at 0 again)
    assert engine_loop(gens_, num_blocks=12, preempted=True) == want


def test_rows_carry_history_only_for_penalised_requests() -> None:
    s = Scheduler(64, 4, 8, 64, max_model_len=64)
    s.add(m.GenRequest("a", [1, 2, 3], 4), "i")
    s.add(m.GenRequest("b", [1, 2, 3], 4, repetition_penalty=1.2, frequency_penalty=0.1), "i")
    plan = s.schedule()
    assert plan is not None
    rows = {r.seq_id: r for r in plan.step.rows}
    assert not rows[0].history and rows[0].sample[0].penalties is None
    assert rows[1].history
    assert rows[1].sample[0].penalties == m.Penalties(0.0, 0.1, 1.2, 3)
    st = rank()
    st.run(plan.step)
    assert list(st.histories) == [1]  # nothing recorded for the request without penalties


def test_the_rank_fails_a_sequence_it_has_no_record_of_alone() -> None:
    st = rank()
    pen = m.Penalties(repetition=2.0, prompt_len=2)

    def spec(seq: int, p: m.Penalties | None = pen) -> list[m.SamplingSpec]:
        return [m.SamplingSpec(seq, temperature=0.0, penalties=p)]

    reply = st.run(m.StepRequest(1, [
        m.StepRow(0, [5, 6], 0, [0], spec(0), history=True),
        m.StepRow(1, [7], 3, [0], spec(1), history=True),  # a rank that restarted mid-way
        m.StepRow(2, [8], 0, [0], spec(2), history=False),  # a malformed row
        m.StepRow(3, [9], 0, [0], spec(3, None)),
    ]))  # fmt: skip
    assert reply.seq_ids == [0, 3]
    assert {f[0]: f[1] for f in reply.failed} == {1: INTERNAL, 2: BAD_REQUEST}
    assert "has not seen every token" in dict((f[0], f[2]) for f in reply.failed)[1]
    # a recompute from position 0 makes the record whole again
    reply = st.run(m.StepRequest(2, [m.StepRow(1, [1, 2, 7], 0, [0], spec(1), history=True)]))
    assert reply.seq_ids == [1] and not reply.failed
    # finished sequences are forgotten
    st.run(m.StepRequest(3, [], finished=[0, 1]))
    assert 0 not in st.histories and 1 not in st.histories


def test_rows_and_specs_of_before_the_penalties_still_decode() -> None:
    old_row = m.pack([4, [1], 0, [0], [], False])
    assert m.unpack(old_row, type=m.StepRow).history is False
    old_spec = m.pack([1, 1.0, 1.0, 0, None, 0, False, 0, None, None])
    assert m.unpack(old_spec, type=m.SamplingSpec).penalties is None
    spec = m.SamplingSpec(1, penalties=m.Penalties(0.5, -0.5, 1.1, 7))
    assert m.unpack(m.pack(spec), type=m.SamplingSpec) == spec


# --------------------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.01),
        ("frequency_penalty", -2.5),
        ("presence_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("frequency_penalty", "x"),
    ],
)
def test_the_engine_refuses_an_out_of_range_penalty_naming_it(
    tmp_path_factory: pytest.TempPathFactory, field: str, value: object
) -> None:
    """Over raw NATS too: the GenRequest's constraints, 400 naming the field."""
    from services.engine.generation import Refused
    from tests.unit.engine.test_logit_bias_admission import generation

    g = generation(tiny_model(tmp_path_factory))
    body = {"request_id": "r1", "prompt_token_ids": [1, 2], "max_tokens": 4, field: value}
    with pytest.raises(Refused) as e:
        g.admit_request(m.pack(body))
    assert e.value.code == 400 and e.value.param == field, e.value
    assert not g.sched.requests


_TINY: list[Any] = []


def tiny_model(tmp: pytest.TempPathFactory) -> Any:
    if not _TINY:
        from services.tiny_model import create_model_dir

        _TINY.append(create_model_dir(tmp.mktemp("m") / "tiny", seed=0))
    return _TINY[0]


def test_the_api_maps_the_penalties_and_the_engine_keeps_them(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from services.api.deps import Deps
    from services.api.openai import OpenAIRoutes
    from shared.settings import Settings
    from tests.unit.engine.test_logit_bias_admission import generation

    model = tiny_model(tmp_path_factory)
    routes = OpenAIRoutes(Deps(Settings(model=str(model), max_n=8, max_model_len=64)))
    pen = {"presence_penalty": -0.5, "frequency_penalty": 2.0, "repetition_penalty": 1.1}
    for chat in (False, True):
        body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        gen = routes.parse(body | pen, chat).gen
        assert (gen.presence_penalty, gen.frequency_penalty, gen.repetition_penalty) == (
            -0.5, 2.0, 1.1
        )  # fmt: skip
        g = generation(model)
        back = g.admit_request(m.pack(gen))
        assert back.repetition_penalty == 1.1 and back.frequency_penalty == 2.0
    off = routes.parse({"prompt": "hi", "presence_penalty": None}, False).gen
    assert (off.presence_penalty, off.frequency_penalty, off.repetition_penalty) == (0, 0, 1)
