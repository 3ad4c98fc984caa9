"""services.worker.model: config, sharding, and the paged forward pass against a dense
numpy reference of the same Llama math (no cache, no paging)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from services.worker import model as mdl
from services.worker.model import Batch, KVCache, TPModel
from shared.model_config import ModelConfig
from shared.sharding import init_weights, shard_names, shard_shape, shard_tensor

TOL = 1e-4


def tiny(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def to_paddle(weights: dict[str, np.ndarray]) -> dict[str, paddle.Tensor]:
    return {k: paddle.to_tensor(v) for k, v in weights.items()}


def scaled(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    # std 0.02 makes every logit nearly equal; scale up so mistakes show in the logits.
    w = init_weights(cfg, seed)
    return {k: v if k.endswith("norm.weight") else v * 10 for k, v in w.items()}


# ---------- dense numpy reference ----------


def ref_logits(cfg: ModelConfig, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits of every position of one sequence, float64, straight from the HF equations."""
    f = {k: v.astype(np.float64) for k, v in w.items()}
    n, d, hd = len(tokens), cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def norm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * g

    def rope(x: np.ndarray) -> np.ndarray:  # x [n, heads, hd]
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
        ang = np.arange(n)[:, None] * inv[None, :]
        ang = np.concatenate([ang, ang], -1)[:, None, :]
        rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    def lin(x: np.ndarray, name: str) -> np.ndarray:
        y = x @ f[name + ".weight"].T
        return y + f[name + ".bias"] if name + ".bias" in f else y

    h = f["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = norm(h, f[p + "input_layernorm.weight"])
        q = rope(lin(x, p + "self_attn.q_proj").reshape(n, nh, hd))
        k = rope(lin(x, p + "self_attn.k_proj").reshape(n, nkv, hd))
        v = lin(x, p + "self_attn.v_proj").reshape(n, nkv, hd)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(causal[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", pr, v).reshape(n, d)
        h = h + lin(o, p + "self_attn.o_proj")
        x = norm(h, f[p + "post_attention_layernorm.weight"])
        g = lin(x, p + "mlp.gate_proj")
        h = h + lin(g / (1 + np.exp(-g)) * lin(x, p + "mlp.up_proj"), p + "mlp.down_proj")
    h = norm(h, f["model.norm.weight"])
    head = f.get("lm_head.weight", f["model.embed_tokens.weight"])
    return h @ head.T


def run(model: TPModel, w: dict[str, paddle.Tensor], kv: KVCache, batch: Batch) -> np.ndarray:
    return model.forward(w, kv, batch).numpy()


def blocks(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


# ---------- config ----------


def test_from_hf_qwen2_and_defaults() -> None:
    cfg = ModelConfig.from_hf(
        {
            "model_type": "qwen2",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": None,  # null: = heads (absent would be Qwen2Config's 32)
            "eos_token_id": [7, 8],
            "rope_scaling": None,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": True,
        }
    )
    assert cfg.attention_bias and cfg.tie_word_embeddings
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4 and cfg.eos_token_id == 7
    assert "lm_head.weight" not in shard_names(cfg)
    assert "model.layers.0.self_attn.k_proj.bias" in shard_names(cfg)


@pytest.mark.parametrize(
    "bad",
    [
        {"model_type": "gpt2"},
        {"hidden_act": "gelu"},
        {"rope_scaling": {"rope_type": "llama3"}},
    ],
)
def test_from_hf_rejects_unsupported(bad: dict[str, object]) -> None:
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError):
        ModelConfig.from_hf({**base, **bad})


@pytest.mark.parametrize(
    "field,heads,kv_heads,inter,tp",
    [
        ("num_attention_heads", 4, 4, 96, 3),
        ("num_key_value_heads", 12, 3, 96, 2),
        ("intermediate_size", 4, 4, 3, 4),  # fewer MLP columns than ranks (90 splits unevenly)
    ],
)
def test_validate_tp_names_field(
    field: str, heads: int, kv_heads: int, inter: int, tp: int
) -> None:
    cfg = tiny(
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
        head_dim=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match=field):
        cfg.validate_tp(tp)
    with pytest.raises(ValueError, match=field):
        KVCache(cfg, 1, 1, tp)
    cfg.validate_tp(1)


def test_config_rejects_inconsistent_heads() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny(num_attention_heads=4, num_key_value_heads=3)


# ---------- sharding ----------


@pytest.mark.parametrize("tp", [1, 2])
def test_shards_concatenate_back(tp: int) -> None:
    cfg = tiny(attention_bias=True)
    full = init_weights(cfg, 0)
    assert list(full) == shard_names(cfg)
    for name, tensor in full.items():
        parts = [shard_tensor(cfg, name, tensor, r, tp) for r in range(tp)]
        for r, part in enumerate(parts):
            assert part.flags.c_contiguous
            assert part.shape == shard_shape(cfg, name, tensor.shape, r, tp)
        if tp == 1 or parts[0].shape == tensor.shape:
            assert all(np.array_equal(p, tensor) for p in parts), name
            continue
        axis = 1 if ("o_proj" in name or "down_proj" in name) else 0
        np.testing.assert_array_equal(np.concatenate(parts, axis=axis), tensor, err_msg=name)
    assert shard_shape(cfg, "model.layers.0.self_attn.o_proj.weight", (64, 64), 1, 2) == (64, 32)
    assert shard_shape(cfg, "model.layers.0.self_attn.q_proj.bias", (64,), 1, 2) == (32,)


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    """tp=4 over 2 kv heads: ranks 0-1 hold kv head 0, ranks 2-3 kv head 1 (the one their
    query heads read); q is split as usual."""
    cfg = tiny(num_attention_heads=8, num_key_value_heads=2, attention_bias=True)
    cfg.validate_tp(4)
    full = init_weights(cfg, 0)
    hd = cfg.head_dim
    for proj in ("k_proj.weight", "v_proj.bias"):
        name = f"model.layers.0.self_attn.{proj}"
        for r in range(4):
            part = shard_tensor(cfg, name, full[name], r, 4)
            head = r // 2
            np.testing.assert_array_equal(part, full[name][head * hd : (head + 1) * hd])
    assert KVCache(cfg, 1, 1, 4).shape[1] == 1
    assert TPModel(cfg, 3, 4).kv_heads == 1


def test_shard_rejects_unknown_and_bad_rank() -> None:
    cfg = tiny()
    with pytest.raises(ValueError, match="unknown"):
        shard_shape(cfg, "model.layers.0.mystery.weight", (4, 4), 0, 1)
    with pytest.raises(ValueError, match="rank"):
        shard_shape(cfg, "model.norm.weight", (64,), 2, 2)


def test_init_weights_deterministic() -> None:
    cfg = tiny()
    a, b, c = init_weights(cfg, 1), init_weights(cfg, 1), init_weights(cfg, 2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert a["model.norm.weight"].dtype == np.float32 and (a["model.norm.weight"] == 1).all()


# ---------- forward ----------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "tie_word_embeddings": True},
        {"num_key_value_heads": 4},
    ],
)
def test_prefill_matches_dense_reference(overrides: dict[str, object]) -> None:
    cfg = tiny(**overrides)
    w = scaled(cfg, 3)
    tokens = [5, 17, 250, 3, 99, 42, 7, 7, 128, 1, 0]
    kv = KVCache(cfg, num_blocks=8, block_size=4, tp=1)
    got = run(TPModel(cfg, 0, 1), to_paddle(w), kv, Batch([tokens], [0], [blocks(0, 3)]))
    want = ref_logits(cfg, w, tokens)[-1]
    assert np.abs(want).max() > 0.5  # the check must be able to see a wrong answer
    np.testing.assert_allclose(got[0], want, atol=TOL, rtol=0)


def test_prefill_then_decode_equals_full_prefill() -> None:
    cfg = tiny(attention_bias=True)
    w = scaled(cfg, 4)
    pw, model = to_paddle(w), TPModel(cfg, 0, 1)
    tokens = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111]
    ref = ref_logits(cfg, w, tokens)
    kv = KVCache(cfg, num_blocks=6, block_size=3, tp=1)
    table = [4, 1, 5, 0]  # non-contiguous, shuffled physical blocks
    out = run(model, pw, kv, Batch([tokens[:5]], [0], [table]))
    np.testing.assert_allclose(out[0], ref[4], atol=TOL, rtol=0)
    for p in range(5, len(tokens)):
        out = run(model, pw, kv, Batch([[tokens[p]]], [p], [table]))
        np.testing.assert_allclose(out[0], ref[p], atol=TOL, rtol=0, err_msg=f"pos {p}")
    fresh = KVCache(cfg, num_blocks=6, block_size=3, tp=1)
    full = run(model, pw, fresh, Batch([tokens], [0], [[2, 3, 0, 5]]))
    np.testing.assert_allclose(out[0], full[0], atol=TOL, rtol=0)


def test_chunked_prefill_matches_reference() -> None:
    cfg = tiny()
    w = scaled(cfg, 5)
    pw, model = to_paddle(w), TPModel(cfg, 0, 1)
    tokens = list(range(40, 53))
    kv = KVCache(cfg, num_blocks=5, block_size=4, tp=1)
    table = [3, 0, 4, 1]
    run(model, pw, kv, Batch([tokens[:6]], [0], [table]))
    out = run(model, pw, kv, Batch([tokens[6:]], [6], [table]))
    np.testing.assert_allclose(out[0], ref_logits(cfg, w, tokens)[-1], atol=TOL, rtol=0)


def test_batched_sequences_equal_each_alone() -> None:
    cfg = tiny()
    w = scaled(cfg, 6)
    pw, model = to_paddle(w), TPModel(cfg, 0, 1)
    a, b, c = [1, 2, 3, 4, 5, 6, 7], [200, 100], [9, 8, 7, 6, 5]
    tables = [[7, 2], [5], [0, 3]]
    kv = KVCache(cfg, num_blocks=8, block_size=4, tp=1)
    # step 1: three prefills of different lengths in one batch
    out = run(model, pw, kv, Batch([a, b, c], [0, 0, 0], tables))
    for row, seq in enumerate((a, b, c)):
        np.testing.assert_allclose(out[row], ref_logits(cfg, w, seq)[-1], atol=TOL, rtol=0)
    # step 2: mixed batch - two decodes of different history length and a prefill chunk
    out = run(model, pw, kv, Batch([[11], [12, 13], [14]], [7, 2, 5], tables))
    wants = [
        ref_logits(cfg, w, a + [11]),
        ref_logits(cfg, w, b + [12, 13]),
        ref_logits(cfg, w, c + [14]),
    ]
    for row, want in enumerate(wants):
        np.testing.assert_allclose(out[row], want[-1], atol=TOL, rtol=0, err_msg=f"row {row}")
    # alone, in a fresh cache, each sequence gives the same logits as when batched
    for row, (seq, table) in enumerate(
        zip((a + [11], b + [12, 13], c + [14]), tables, strict=True)
    ):
        alone = KVCache(cfg, num_blocks=8, block_size=4, tp=1)
        single = run(model, pw, alone, Batch([seq], [0], [table]))
        np.testing.assert_allclose(single[0], out[row], atol=TOL, rtol=0)


def test_equal_prefill_chunks_share_one_attention_group() -> None:
    """Prompts of one length reading as many blocks run their attention as one group (one
    set of batched matmuls, not one per prompt), with their own causal masks; any other
    chunk runs alone, decodes together. Logits equal the dense reference either way."""
    cfg = tiny()
    w = scaled(cfg, 8)
    pw, model = to_paddle(w), TPModel(cfg, 0, 1)
    kv = KVCache(cfg, num_blocks=16, block_size=4, tp=1)
    a, b, c, d = [1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14, 15], [16, 17]
    tables = [[0, 1], [2], [3, 4], [5]]
    run(model, pw, kv, Batch([a[:1], b, c[:2], d], [0, 0, 0, 0], tables))
    # a and c: 5 new tokens from positions 1 and 2, both reading 2 blocks: one group
    batch = Batch([a[1:], [20], c[2:] + [21], [22]], [1, 3, 2, 2], tables)
    tabs = [np.asarray(t) for t in tables]
    groups, restore = mdl._attention_groups(batch, tabs, [0, 5, 6, 11], 4, 2, 2)
    assert sorted((g.seqs, g.new_tokens) for g in groups) == [(2, 1), (2, 5)]
    assert restore is not None
    out = run(model, pw, kv, batch)
    seqs = (a, b + [20], c + [21], d + [22])
    for row, seq in enumerate(seqs):
        want = ref_logits(cfg, w, seq)[-1]
        np.testing.assert_allclose(out[row], want, atol=TOL, rtol=0, err_msg=f"row {row}")


def test_last_layer_runs_on_the_sampled_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """With prompt chunks in the step, the last layer writes every row's K/V but runs q,
    o_proj and the MLP on each sequence's last row only (the only rows sampled); earlier
    layers run on every row. The logits still equal the dense reference (a mixed batch:
    two prompt chunks and a decode row)."""
    cfg = tiny(attention_bias=True)
    w = scaled(cfg, 10)
    pw, model = to_paddle(w), TPModel(cfg, 0, 1)
    kv = KVCache(cfg, num_blocks=8, block_size=4, tp=1)
    a, b, c = [5, 6, 7, 8, 9], [10, 11, 12], [13, 14]
    tables = [[0, 1], [2], [3]]
    run(model, pw, kv, Batch([c], [0], [tables[2]]))
    rows: dict[str, list[int]] = {}
    names = {id(t): n for n, t in pw.items()}
    linear = mdl._linear

    def spy(
        x: paddle.Tensor, wt: paddle.Tensor, bias: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        rows.setdefault(names.get(id(wt), "?"), []).append(x.shape[0])
        return linear(x, wt, bias)

    monkeypatch.setattr(mdl, "_linear", spy)
    out = run(model, pw, kv, Batch([a, b, [15]], [0, 0, 2], tables))
    for row, seq in enumerate((a, b, c + [15])):
        want = ref_logits(cfg, w, seq)[-1]
        np.testing.assert_allclose(out[row], want, atol=TOL, rtol=0, err_msg=f"row {row}")
    last = cfg.num_hidden_layers - 1
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sampled = 3 if i == last else 9  # 5 + 3 + 1 rows; 3 sequences
        for name in ("q_proj", "o_proj"):
            assert rows[p + f"self_attn.{name}.weight"] == [sampled], (i, name)
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert rows[p + f"mlp.{name}.weight"] == [sampled], (i, name)
        for name in ("k_proj", "v_proj"):  # every row's K/V goes to the cache
            assert rows[p + f"self_attn.{name}.weight"] == [9], (i, name)


def test_many_rows_take_the_wide_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """From WIDE_ROWS rows on a linear computes x @ w^T: the same logits."""
    cfg = tiny(attention_bias=True)
    w = scaled(cfg, 9)
    tokens = [(13 * i) % 300 for i in range(12)]
    monkeypatch.setattr(mdl, "WIDE_ROWS", 8)
    kv = KVCache(cfg, num_blocks=4, block_size=4, tp=1)
    got = run(TPModel(cfg, 0, 1), to_paddle(w), kv, Batch([tokens], [0], [blocks(0, 3)]))
    np.testing.assert_allclose(got[0], ref_logits(cfg, w, tokens)[-1], atol=TOL, rtol=0)


def test_forward_rejects_bad_batches() -> None:
    cfg = tiny()
    pw, model = to_paddle(init_weights(cfg, 0)), TPModel(cfg, 0, 1)
    kv = KVCache(cfg, num_blocks=2, block_size=4, tp=1)
    with pytest.raises(ValueError, match="block table"):
        model.forward(pw, kv, Batch([[1] * 5], [0], [[0]]))
    with pytest.raises(ValueError, match="block table"):
        model.forward(pw, kv, Batch([[1]], [0], [[2]]))
    with pytest.raises(ValueError, match="token id"):
        model.forward(pw, kv, Batch([[300]], [0], [[0]]))
    with pytest.raises(KeyError, match="weights lack"):
        model.forward({}, kv, Batch([[1]], [0], [[0]]))


def test_kv_cache_free_and_allocate() -> None:
    cfg = tiny()
    kv = KVCache(cfg, num_blocks=3, block_size=4, tp=2)
    assert kv.allocated and kv.keys[0].shape == [3, 1, 4, 16]
    assert kv.nbytes == 2 * 2 * 3 * 4 * 1 * 16 * 4
    kv.free()
    assert not kv.allocated
    with pytest.raises(RuntimeError, match="not allocated"):
        TPModel(cfg, 0, 1).forward(to_paddle(init_weights(cfg, 0)), kv, Batch([[1]], [0], [[0]]))
    kv.allocate()
    assert kv.allocated and float(kv.values[1].abs().sum()) == 0.0


class _OneRankShm:
    """Stands in for the shared-memory all-reduce of one rank: keeps what the rank
    contributes (the peers' shares are zero-padded elsewhere, so the sum is theirs)."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.sent: list[np.ndarray] = []

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def reduce(self, a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        self.sent.append(a.copy())
        return a


@pytest.mark.parametrize("vocab", [300, 301])  # 301: shares of unequal size
def test_each_rank_projects_onto_its_share_of_the_vocabulary(vocab: int) -> None:
    """Over shm each rank reads only its 1/tp of the (replicated) head: rows outside its
    share are NaN here and must not reach the logits. The ranks' zero-padded shares sum
    to the projection onto the whole head; without room in the slot every rank projects
    onto the whole head and sends nothing."""
    cfg = tiny(vocab_size=vocab)
    rng = np.random.default_rng(3)
    h = paddle.to_tensor(rng.standard_normal((5, cfg.hidden_size)).astype(np.float32))
    head = rng.standard_normal((vocab, cfg.hidden_size)).astype(np.float32)
    full = (h.numpy() @ head.T).astype(np.float32)
    total = np.zeros_like(full)
    for rank in range(2):
        lo, hi = rank * vocab // 2, (rank + 1) * vocab // 2
        poisoned = np.full_like(head, np.nan)
        poisoned[lo:hi] = head[lo:hi]
        shm = _OneRankShm(slot_bytes=5 * vocab * 4)
        got = TPModel(cfg, rank, 2, shm=shm)._project_vocab(h, paddle.to_tensor(poisoned)).numpy()
        assert len(shm.sent) == 1 and np.isfinite(got).all()
        assert not got[:, :lo].any() and not got[:, hi:].any()
        np.testing.assert_allclose(got[:, lo:hi], full[:, lo:hi], rtol=1e-5, atol=1e-5)
        total += got
    np.testing.assert_allclose(total, full, rtol=1e-5, atol=1e-5)
    small = _OneRankShm(slot_bytes=5 * vocab * 4 - 4)  # the logits do not fit: whole head
    got = TPModel(cfg, 1, 2, shm=small)._project_vocab(h, paddle.to_tensor(head)).numpy()
    assert not small.sent
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"qk_norm": True, "head_dim": 32},
     {"rope_type": "dynamic", "rope_factor": 2.0, "max_position_embeddings": 6}],
)  # fmt: skip
def test_last_layer_on_sampled_rows_equals_all_rows_over_steps(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object]
) -> None:
    """Steps mixing prompt chunks that are not a prompt's last, last chunks, decode rows
    and one prompt shared by two sequences: the logits and every layer's K/V cache (the
    last layer's included) equal those of the step run on all rows (no tail)."""
    cfg = tiny(**overrides)
    pw = to_paddle(scaled(cfg, 3))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in (7, 2, 5)]
    prompts.append(prompts[0])  # n > 1: one prompt, two choices
    decoded = [list(map(int, rng.integers(0, cfg.vocab_size, 8))) for _ in prompts]

    def steps() -> tuple[list[np.ndarray], list[np.ndarray]]:
        model, kv = TPModel(cfg, 0, 1), KVCache(cfg, num_blocks=40, block_size=4, tp=1)
        done, outs = [0] * 4, []
        for step in range(7):
            toks, starts, tables = [], [], []
            for s in range(min(step + 1, 4)):  # staggered arrivals
                n = len(prompts[s])
                new = prompts[s][done[s] : done[s] + 3] if done[s] < n else [decoded[s][step]]
                toks.append(new)
                starts.append(done[s])
                tables.append(blocks(10 * s, 10))
                done[s] += len(new)
            outs.append(run(model, pw, kv, Batch(toks, starts, tables)))
        return outs, [c.numpy() for c in kv.keys + kv.values]

    tailed = steps()
    plan = TPModel._plan

    def no_tail(self: TPModel, kv: KVCache, batch: Batch) -> mdl._Plan:
        p = plan(self, kv, batch)
        p.tail = None
        return p

    monkeypatch.setattr(TPModel, "_plan", no_tail)
    full = steps()
    for a, b in zip(tailed[0], full[0], strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    for a, b in zip(tailed[1], full[1], strict=True):
        np.testing.assert_array_equal(a, b)
