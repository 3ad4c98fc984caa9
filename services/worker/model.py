"""Llama-family decoder (llama, qwen2, qwen3, ernie4_5 dense) with tensor parallelism and
a paged KV cache. The architecture comes from :class:`shared.model_config.ModelConfig`.

Pure compute: the caller owns the weights (a dict of this rank's shards, HF names and
HF layout ``[out, in]``, paddle tensors of one float dtype: float32 on CPU, the
checkpoint's bf16 / fp16 on GPU, see ``hf_files.compute_dtype``) and the :class:`KVCache`
(of the same dtype); the model holds no parameters, so swapping the dict is a weight
update and dropping it is sleep.

Sharding over ``tp`` ranks follows :mod:`shared.sharding` (Megatron style): the partial
outputs of the row-parallel o_proj and down_proj are summed with one ``all_reduce`` each
per layer. The vocabulary is replicated rather than vocab-parallel so every rank returns
full logits with no extra all-gather; the price is ``vocab * hidden * 4`` bytes per rank.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

from shared.model_config import ModelConfig
from shared.sharding import local_kv_heads, shard_names


def _prefer_avx2_mkl_on_amd() -> None:
    # Paddle's bundled MKL takes a generic slow path on AMD CPUs (fp32 GEMM ~4x slower,
    # measured on EPYC); this MKL honours MKL_DEBUG_CPU_TYPE=5 (use AVX2). MKL reads it at
    # the first BLAS call, so setting it at import is early enough. An explicit value wins.
    try:
        with Path("/proc/cpuinfo").open() as f:
            amd = "AuthenticAMD" in f.read(4096)
    except OSError:
        return
    if amd:
        os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")


_prefer_avx2_mkl_on_amd()

HEAP_TOP_PAD = 64 << 20  # bytes of free heap top glibc keeps instead of returning them


M_TOP_PAD = -2  # glibc mallopt parameter
GLIBC_TOP_PAD = 128 << 10  # its default


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (glibc's, or AttributeError)
    except (OSError, AttributeError):  # not glibc: its own policy
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


_LIBC = _glibc()


def _keep_heap_for_step_temporaries() -> None:
    # Paddle's CPU tensors come from glibc malloc. A prefill frees and allocates MBs of
    # temporaries per op ([tokens, intermediate] activations), and glibc hands the heap's
    # free top back to the OS once it exceeds ~2x the largest freed block, so the next
    # layer's temporaries are fresh pages: 3-8 thousand page faults (12-30 MB the kernel
    # zeroes) per 16 x 16-token prefill of the bench model, 10-60 ms of system time a rank.
    # Keeping 64 MiB of free top (M_TOP_PAD) removes them. Setting it also turns glibc's
    # dynamic mmap threshold off (do_set_top_pad): a block of >= 128 KiB is mmap'd and
    # faulted in at every allocation, never reused from the heap (a 4 MiB malloc/free
    # loop: 1025 faults a round, 0 without the pad). A prefill's faults still went to 0
    # from the 2nd-3rd one on (bench model, 16 x 16 tokens: paddle's temporaries of that
    # size are few). release_heap() gives the top back (sleep, weight swaps).
    if _LIBC is not None:
        _LIBC.mallopt(M_TOP_PAD, HEAP_TOP_PAD)


_keep_heap_for_step_temporaries()


def release_heap() -> None:
    """Return every free heap page to the OS, the kept top included. ``malloc_trim(0)``
    trims the main heap's top and free pages inside every heap, but not the top of a
    thread's own heap (where the compute thread's temporaries live): glibc trims that
    only when a block of >= 64 KiB is freed in it, keeping ``M_TOP_PAD``. So: default pad,
    one such free from this thread (the compute thread: control calls run on it), trim,
    then the step pad again."""
    if _LIBC is None:
        return
    _LIBC.mallopt(M_TOP_PAD, GLIBC_TOP_PAD)
    try:
        _LIBC.free(_LIBC.malloc(64 << 10))
        _LIBC.malloc_trim(0)
    finally:
        _LIBC.mallopt(M_TOP_PAD, HEAP_TOP_PAD)


class KVCache:
    """Paged KV cache for one rank: per layer a key and a value paddle tensor of shape
    [num_blocks, local_kv_heads, block_size, head_dim] (in the weights' dtype, float32 by
    default). Heads before slots: the (block, head) rows of a sequence's blocks, gathered in
    (head, block) order, are already the [heads, keys, head_dim] operand of attention's
    batched matmuls, so a step moves no cache data but the one gather of its blocks.

    ``nbytes`` is the footprint when allocated; it does not drop to 0 after ``free``."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, tp: int, dtype: str = "float32"
    ) -> None:
        cfg.validate_tp(tp)
        self.dtype = dtype
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_layers = cfg.num_hidden_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.shape = (num_blocks, local_kv_heads(cfg, tp), block_size, cfg.head_dim)
        self.keys: list[paddle.Tensor] = []
        self.values: list[paddle.Tensor] = []
        self.allocate()

    @property
    def nbytes(self) -> int:
        size = {"bfloat16": 2, "float16": 2}.get(self.dtype) or np.dtype(self.dtype).itemsize
        return 2 * self.num_layers * math.prod(self.shape) * size

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def allocate(self) -> None:
        self.free()
        self.keys = [paddle.zeros(self.shape, self.dtype) for _ in range(self.num_layers)]
        self.values = [paddle.zeros(self.shape, self.dtype) for _ in range(self.num_layers)]

    def free(self) -> None:
        # _clear_data releases the storage even if someone still holds a reference.
        for t in self.keys + self.values:
            t._clear_data()
        self.keys, self.values = [], []


@dataclass
class Batch:
    """One engine step. Each sequence contributes `len(token_ids)` new tokens (prefill: the whole
    prompt or a chunk of it; decode: 1 token). positions start at `start_pos` (= number of tokens
    of this sequence already in the KV cache). block_table lists the physical KV blocks of the
    sequence in order; token at position p is stored in block block_table[p // block_size] at
    slot p % block_size."""

    token_ids: list[list[int]]
    start_pos: list[int]
    block_tables: list[list[int]]


@dataclass
class _Group:
    """Sequences whose attention runs as one set of batched matmuls (same number of new
    tokens): S sequences of n new tokens, each reading nb cache blocks (padded)."""

    rows: paddle.Tensor | None  # [S * n] rows of the flat token batch; None: all, in order
    kv_rows: paddle.Tensor  # [S * KV * nb] (block, kv head) rows of the flat cache to read
    seqs: int
    new_tokens: int
    num_blocks: int
    mask: paddle.Tensor  # [S, KV or 1, n * g, nb * block_size] additive: 0 visible, -inf not
    q_rows: paddle.Tensor | None = None  # n > 1: (seq, token, kv) rows -> (seq, kv, token)
    out_rows: paddle.Tensor | None = None  # and back


FULL_MASK = 1 << 22  # elements: a prefill mask up to this size is spread over the KV heads


@dataclass
class _Tail:
    """The last layer of a step with prompt chunks: only each sequence's last row is
    sampled, so past its K/V write that layer runs on those rows alone (one query per
    sequence, read like a decode step's)."""

    cos_q: paddle.Tensor  # [num_seqs, heads, head_dim]
    sin_q: paddle.Tensor
    groups: list[_Group]
    restore: paddle.Tensor | None


@dataclass
class _Plan:
    token_ids: paddle.Tensor  # [T]
    cos_q: paddle.Tensor  # [T, heads, head_dim], already broadcast (see _rope)
    sin_q: paddle.Tensor
    cos_k: paddle.Tensor  # [T, kv_heads, head_dim]
    sin_k: paddle.Tensor
    write: paddle.Tensor  # [T * KV] row of each new (token, kv head) in a flat cache view
    last_rows: paddle.Tensor  # [num_seqs]
    groups: list[_Group] = field(default_factory=list)
    restore: paddle.Tensor | None = None  # inverse of the grouped row order, None if identity
    tail: _Tail | None = None  # the last layer on the sampled rows only (None: all rows are)


class TPModel:
    def __init__(
        self, cfg: ModelConfig, rank: int, tp: int, group: Any = None, shm: Any = None
    ) -> None:
        cfg.validate_tp(tp)
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} out of range for tp={tp}")
        self.cfg, self.rank, self.tp, self.group = cfg, rank, tp, group
        self.shm = shm  # a ShmAllReduce (same-host CPU ranks) or None: gloo/NCCL
        self.heads = cfg.num_attention_heads // tp
        self.kv_heads = local_kv_heads(cfg, tp)
        self._names = shard_names(cfg)
        self._cos = self._sin = np.zeros((0, cfg.head_dim), np.float32)
        self._grow_rope(cfg.max_position_embeddings)

    def _grow_rope(self, length: int) -> None:
        self._cos, self._sin = rope_tables(self.cfg, np.arange(length), inv_freq(self.cfg))

    def _plan(self, kv: KVCache, batch: Batch) -> _Plan:
        n_seqs = len(batch.token_ids)
        if not n_seqs or not len(batch.start_pos) == len(batch.block_tables) == n_seqs:
            raise ValueError("batch needs token_ids, start_pos and block_tables for >= 1 seqs")
        bs = kv.block_size
        ids: list[int] = []  # every new token of the step, sequence after sequence
        last: list[int] = []  # row of each sequence's last new token
        firsts: list[int] = []  # row of each sequence's first new token
        pos: list[np.ndarray] = []
        wblk: list[np.ndarray] = []
        wslot: list[np.ndarray] = []
        tables: list[np.ndarray] = []
        for s, (toks, start, table) in enumerate(
            zip(batch.token_ids, batch.start_pos, batch.block_tables, strict=True)
        ):
            end = start + len(toks)
            tbl = np.asarray(table, dtype=np.int64)
            if not toks or start < 0:
                raise ValueError(f"sequence {s}: needs >= 1 new token and start_pos >= 0")
            if len(tbl) * bs < end or (tbl < 0).any() or (tbl >= kv.num_blocks).any():
                raise ValueError(f"sequence {s}: block table {table} cannot hold {end} tokens")
            p = np.arange(start, end)
            firsts.append(len(ids))
            ids.extend(toks)
            pos.append(p)
            wblk.append(tbl[p // bs])
            wslot.append(p % bs)
            last.append(len(ids) - 1)
            tables.append(tbl)
        token_ids = np.asarray(ids, dtype=np.int64)
        if token_ids.min() < 0 or token_ids.max() >= self.cfg.vocab_size:
            raise ValueError("token id out of range for vocab_size")
        positions = np.concatenate(pos)
        if positions.max() >= len(self._cos):
            self._grow_rope(2 * int(positions.max()) + 1)
        cos, sin = self._cos[positions], self._sin[positions]
        if self.cfg.rope_type == "dynamic":
            # transformers' dynamic NTK: a forward whose sequence reaches past
            # max_position_embeddings rotates its new q/k with a base grown for that
            # length; cached keys keep the rotation they were written with.
            for s, p in enumerate(pos):
                end = int(p[-1]) + 1
                if end > self.cfg.max_position_embeddings:
                    rows = slice(firsts[s], firsts[s] + len(p))
                    cos[rows], sin[rows] = rope_tables(self.cfg, p, inv_freq(self.cfg, end))
        if not self.cfg.rope_interleaved:  # rotate_half's sign folded into sin (see _rope)
            sin = sin.copy()
            sin[:, : sin.shape[1] // 2] *= -1
        t, kvh, d = len(ids), self.kv_heads, self.cfg.head_dim

        def spread(table: np.ndarray, heads: int) -> paddle.Tensor:
            # broadcast on the host: paddle's CPU broadcast over a middle axis is slow
            full = np.broadcast_to(table[:, None], (len(table), heads, d))
            return paddle.to_tensor(np.ascontiguousarray(full))

        plan = _Plan(
            token_ids=paddle.to_tensor(token_ids),
            cos_q=spread(cos, self.heads),
            sin_q=spread(sin, self.heads),
            cos_k=spread(cos, kvh),
            sin_k=spread(sin, kvh),
            write=paddle.to_tensor(
                (np.concatenate(wblk)[:, None] * kvh + np.arange(kvh)) * bs
                + np.concatenate(wslot)[:, None]
            ).reshape([-1]),
            last_rows=paddle.to_tensor(np.asarray(last, dtype=np.int64)),
        )
        plan.groups, plan.restore = _attention_groups(
            batch, tables, firsts, bs, kvh, self.heads // kvh
        )
        if t > n_seqs:
            # Prompt chunks: the last layer's output is read at each sequence's last row
            # only, so after writing every row's K/V it runs q, attention, o_proj and the
            # MLP on those rows (a 16 x 16-token prefill: ~11 % of its FLOPs). The same
            # rows and values; only the float32 order of some sums may differ.
            ends = Batch(
                [[0]] * n_seqs,
                [int(e) for e in positions[last]],
                batch.block_tables,
            )
            groups, restore = _attention_groups(
                ends, tables, list(range(n_seqs)), bs, kvh, self.heads // kvh
            )
            plan.tail = _Tail(spread(cos[last], self.heads), spread(sin[last], self.heads),
                              groups, restore)  # fmt: skip
        return plan

    @paddle.no_grad()
    def forward(
        self, weights: dict[str, paddle.Tensor], kv: KVCache, batch: Batch
    ) -> paddle.Tensor:
        """Float32 logits [num_seqs, vocab_size] at the last new position of each sequence,
        identical on every rank."""
        missing = [n for n in self._names if n not in weights]
        if missing:
            raise KeyError(f"weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        if not kv.allocated:
            raise RuntimeError("KV cache is not allocated")
        plan = self._plan(kv, batch)
        cfg = self.cfg
        dtype = weights["model.embed_tokens.weight"].dtype
        if dtype != paddle.float32:  # bf16 / fp16 weights (GPU): tables and cache follow
            if kv.keys[0].dtype != dtype:
                raise ValueError(f"KV cache is {kv.keys[0].dtype}, the weights are {dtype}")
            _cast_plan(plan, dtype)
        h = F.embedding(plan.token_ids, weights["model.embed_tokens.weight"])
        layers = cfg.num_hidden_layers
        for i in range(layers):
            p = f"model.layers.{i}."
            x = _rms_norm(h, weights[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            tail = plan.tail if i == layers - 1 else None
            attn = self._attention(weights, p + "self_attn.", x, kv, i, plan, tail)
            if tail is not None:  # from here on, each sequence's last row only
                h = paddle.gather(h, plan.last_rows)
            h = h + self._all_reduce(_linear(attn, weights[p + "self_attn.o_proj.weight"]))
            if cfg.o_proj_bias:  # whole on every rank: added after the sum, once
                h = h + weights[p + "self_attn.o_proj.bias"]
            x = _rms_norm(h, weights[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            # llama's mlp_bias: column-parallel gate/up biases (absent: None)
            gate = F.silu(
                _linear(
                    x, weights[p + "mlp.gate_proj.weight"], weights.get(p + "mlp.gate_proj.bias")
                )
            )
            up = _linear(x, weights[p + "mlp.up_proj.weight"], weights.get(p + "mlp.up_proj.bias"))
            h = h + self._all_reduce(_linear(gate * up, weights[p + "mlp.down_proj.weight"]))
            if cfg.mlp_bias:
                h = h + weights[p + "mlp.down_proj.bias"]
        # Only the last position of each sequence is sampled: norm and project just those.
        if plan.tail is None:
            h = paddle.gather(h, plan.last_rows)
        h = _rms_norm(h, weights["model.norm.weight"], cfg.rms_norm_eps)
        head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        logits = self._project_vocab(h, head)
        return logits if dtype == paddle.float32 else logits.astype("float32")

    def _project_vocab(self, h: paddle.Tensor, head: paddle.Tensor) -> paddle.Tensor:
        """Logits of ``h`` [n, hidden] over the whole vocabulary, on every rank.

        The head is replicated, but streaming all of it each decode step costs every rank
        as much as a sixth of its layers' weights (bench model: 16 of ~205 MB per rank;
        a decode step's matmuls are bound by memory bandwidth). Over the shared-memory
        all-reduce each rank projects onto its 1/tp of the vocabulary (a row slice of the
        head is a view, no copy), and the shares, zero-padded to the full width, are
        summed: ``x + 0`` is ``x``, so every rank gets the same full logits, each one the
        same dot product a projection onto the whole head computes. Without shm (gloo,
        GPU), or logits larger than its slot, every rank projects onto the whole head
        (every rank sees the same shapes, so all take the same path)."""
        vocab, n = head.shape[0], h.shape[0]
        shm = self.shm
        if self.tp == 1 or shm is None or h.dtype != paddle.float32:
            return _linear(h, head)
        if not shm.fits(n * vocab * 4):
            return _linear(h, head)
        lo, hi = self.rank * vocab // self.tp, (self.rank + 1) * vocab // self.tp
        full = np.zeros((n, vocab), np.float32)
        full[:, lo:hi] = _linear(h, head[lo:hi]).numpy()
        return paddle.to_tensor(shm.reduce(full, out=full))

    def share_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's ``tokens`` on every rank (the others pass as many zeros). One small
        all-reduce in which only rank 0's values are not 0: the sum is rank 0's values,
        exactly (token ids are far below float32's 2**24 integers)."""
        if self.tp == 1 or not tokens:
            return tokens
        a = np.asarray(tokens if self.rank == 0 else [0] * len(tokens), np.float32)
        shm = self.shm
        if shm is not None and shm.fits(a.nbytes):
            out = shm.reduce(a)
        else:
            t = paddle.to_tensor(a)
            dist.all_reduce(t, group=self.group)
            out = t.numpy()
        return [int(x) for x in out]

    def _all_reduce(self, t: paddle.Tensor) -> paddle.Tensor:
        if self.tp > 1:
            shm = self.shm
            if shm is not None and t.dtype == paddle.float32 and shm.fits(math.prod(t.shape) * 4):
                # .numpy() of _linear's transposed view: one copy into row-major order,
                # ~3x faster than paddle's .contiguous() of it (its strided copy)
                return paddle.to_tensor(shm.reduce(t.numpy()))
            if not t.is_contiguous():  # _linear's output is a transposed view
                t = t.contiguous()
            dist.all_reduce(t, group=self.group)
        return t

    def _attention(
        self,
        weights: dict[str, paddle.Tensor],
        prefix: str,
        x: paddle.Tensor,
        kv: KVCache,
        layer: int,
        plan: _Plan,
        tail: _Tail | None = None,
    ) -> paddle.Tensor:
        """Attention of the step's rows -> [rows, heads * head_dim]; with ``tail``, every
        row's K/V is written but only each sequence's last row is a query."""
        d = self.cfg.head_dim

        def project(x: paddle.Tensor, name: str, heads: int) -> paddle.Tensor:
            bias = weights[f"{prefix}{name}.bias"] if self.cfg.attention_bias else None
            return _linear(x, weights[f"{prefix}{name}.weight"], bias).reshape([-1, heads, d])

        xq = x if tail is None else paddle.gather(x, plan.last_rows)
        q, k = project(xq, "q_proj", self.heads), project(x, "k_proj", self.kv_heads)
        v = project(x, "v_proj", self.kv_heads)
        if self.cfg.qk_norm:  # qwen3: per-head RMSNorm over head_dim, before RoPE
            eps = self.cfg.rms_norm_eps
            q = _rms_norm(q, weights[f"{prefix}q_norm.weight"], eps)
            k = _rms_norm(k, weights[f"{prefix}k_norm.weight"], eps)
        inter = self.cfg.rope_interleaved
        cos_q, sin_q = (plan.cos_q, plan.sin_q) if tail is None else (tail.cos_q, tail.sin_q)
        q, k = _rope(q, cos_q, sin_q, inter), _rope(k, plan.cos_k, plan.sin_k, inter)
        k_cache, v_cache = kv.keys[layer], kv.values[layer]
        # Write first, then read: new tokens see themselves and earlier chunks via the cache.
        # (a reshape of the contiguous cache is a view: the scatter writes into the cache)
        paddle.scatter_(k_cache.reshape([-1, d]), plan.write, k.reshape([-1, d]))
        paddle.scatter_(v_cache.reshape([-1, d]), plan.write, v.reshape([-1, d]))
        q = q * (d**-0.5)
        groups, restore = (
            (plan.groups, plan.restore) if tail is None else (tail.groups, tail.restore)
        )
        outs = []
        for g in groups:
            qg = q if g.rows is None else paddle.gather(q, g.rows)
            outs.append(_attend(qg, k_cache, v_cache, g, self.kv_heads))
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
        return out if restore is None else paddle.gather(out, restore)


def _attention_groups(
    batch: Batch,
    tables: list[np.ndarray],
    firsts: list[int],
    block_size: int,
    kv_heads: int,
    group_size: int,
) -> tuple[list[_Group], paddle.Tensor | None]:
    """Split the step's sequences into attention groups; also return the row permutation
    that puts grouped outputs back in batch order (None when already in order).

    Decode sequences (1 new token) share one padded set of matmuls. Longer chunks share
    one when they have the same length and read the same number of cache blocks (a batch
    of prompts arriving together), so no padding multiplies a prompt length; any other
    chunk runs alone."""
    lengths = [len(t) for t in batch.token_ids]
    decode = [s for s, n in enumerate(lengths) if n == 1]
    chunks: dict[tuple[int, int], list[int]] = {}
    for s, n in enumerate(lengths):
        if n > 1:
            key = (n, -(-(batch.start_pos[s] + n) // block_size))
            chunks.setdefault(key, []).append(s)
    grouping = ([decode] if decode else []) + list(chunks.values())
    groups: list[_Group] = []
    order: list[int] = []
    bs = block_size
    for seqs in grouping:
        n = lengths[seqs[0]]
        seen = [batch.start_pos[s] + n for s in seqs]
        nb = -(-max(seen) // bs)
        blocks = np.empty((len(seqs), nb), np.int64)
        rows: list[int] = []
        for i, s in enumerate(seqs):
            used = -(-seen[i] // bs)
            blocks[i, :used] = tables[s][:used]
            blocks[i, used:] = tables[s][0]  # padding: any valid block, masked out
            rows.extend(range(firsts[s], firsts[s] + n))
        order.extend(rows)
        # the keys of (sequence, kv head) as one [nb * block_size, head_dim] operand: rows
        # (block, kv head) of the flat cache, in order (sequence, kv head, block)
        kv_rows = blocks[:, None, :] * kv_heads + np.arange(kv_heads)[None, :, None]
        # visible[s, ni, j]: key position j is at or before query ni's position
        qpos = np.asarray([batch.start_pos[s] for s in seqs])[:, None] + np.arange(n)
        visible = np.arange(nb * bs)[None, None] <= qpos[:, :, None]
        mask = np.where(visible, np.float32(0.0), np.float32(-np.inf))
        mask = np.repeat(mask, group_size, axis=1)[:, None]  # rows (query, head in group)
        if mask.size * kv_heads <= FULL_MASK:  # paddle's CPU broadcast over a middle axis
            # is slow: spread it here unless large (a long prompt's stays 1/KV of the scores)
            mask = np.broadcast_to(mask, (len(seqs), kv_heads, *mask.shape[2:]))
        q_rows = out_rows = None
        if n > 1:  # queries are rows (sequence, token, kv head); attention wants kv heads first
            perm = (
                np.arange(len(seqs))[:, None, None] * n * kv_heads
                + np.arange(kv_heads)[None, :, None]
                + np.arange(n)[None, None, :] * kv_heads
            ).reshape(-1)
            q_rows = paddle.to_tensor(perm)
            out_rows = paddle.to_tensor(np.argsort(perm).astype(np.int64))
        groups.append(
            _Group(
                rows=None if len(grouping) == 1 else paddle.to_tensor(np.asarray(rows, np.int64)),
                kv_rows=paddle.to_tensor(kv_rows.reshape(-1)),
                seqs=len(seqs),
                new_tokens=n,
                num_blocks=nb,
                mask=paddle.to_tensor(np.ascontiguousarray(mask)),
                q_rows=q_rows,
                out_rows=out_rows,
            )
        )
    if order == list(range(len(order))):
        return groups, None
    return groups, paddle.to_tensor(np.argsort(np.asarray(order)).astype(np.int64))


def _cast_plan(plan: _Plan, dtype: Any) -> None:
    """The plan's float tables (RoPE cos / sin, attention masks; built in float32) in the
    weights' ``dtype``."""
    for name in ("cos_q", "sin_q", "cos_k", "sin_k"):
        setattr(plan, name, getattr(plan, name).astype(dtype))
    groups = plan.groups
    if plan.tail is not None:
        plan.tail.cos_q, plan.tail.sin_q = (
            plan.tail.cos_q.astype(dtype), plan.tail.sin_q.astype(dtype)
        )  # fmt: skip
        groups = groups + plan.tail.groups
    for g in groups:
        g.mask = g.mask.astype(dtype)


WIDE_ROWS = 192  # from this many rows on, _linear computes x @ w^T


def _linear(x: paddle.Tensor, w: paddle.Tensor, b: paddle.Tensor | None = None) -> paddle.Tensor:
    # HF layout [out, in]: y = (w @ x^T)^T. With few rows (decode) MKL streams w in this
    # orientation 1.3x (one thread) to 3x (two threads on a busy host) faster than as
    # x @ w^T (measured on the bench model's MLP); from ~200 rows on (a batch of prompts)
    # x @ w^T is the faster one (~10% at 256 rows). The result is the same up to the
    # order of the float32 sums.
    if x.shape[0] >= WIDE_ROWS:
        y = paddle.matmul(x, w, transpose_y=True)
    else:
        y = paddle.matmul(w, x, transpose_y=True).T
    return y if b is None else y + b


def _rms_norm(x: paddle.Tensor, w: paddle.Tensor, eps: float) -> paddle.Tensor:
    # x * x, not x.pow(2): the same values, and paddle's CPU pow is ~50x slower
    return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + eps) * w


def inv_freq(cfg: ModelConfig, seq_len: int = 0) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2] (float64) as transformers computes them for
    the config's rope type; ``seq_len`` (the sequence length reached) matters for
    ``dynamic`` only."""
    d, base, factor = cfg.head_dim, cfg.rope_theta, cfg.rope_factor
    if cfg.rope_type == "dynamic":
        length = max(seq_len, cfg.max_position_embeddings)
        base *= ((factor * length / cfg.max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_type == "linear":
        inv = inv / factor
    elif cfg.rope_type == "llama3":
        old = cfg.rope_original_max_position_embeddings or cfg.max_position_embeddings
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rope_tables(
    cfg: ModelConfig, positions: np.ndarray, inv: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [len(positions), head_dim] (float32) in the layout :func:`_rope` uses:
    HF "rotate_half" repeats the frequency vector; interleaved RoPE repeats each one."""
    freqs = np.outer(np.asarray(positions, dtype=np.float64), inv)
    if cfg.rope_interleaved:
        emb = np.repeat(freqs, 2, axis=-1)
    else:
        emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _rope(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, interleaved: bool = False
) -> paddle.Tensor:
    """x [T, heads, d] rotated; cos/sin [T, heads, d] (broadcast by the plan). For
    rotate_half, ``sin``'s first half is negated by the plan: ``x * cos + swap(x) * sin``
    then equals HF's ``x * cos + rotate_half(x) * sin`` bit for bit."""
    if interleaved:  # pairs (2i, 2i+1) -> (-x[2i+1], x[2i])
        pairs = x.reshape([*x.shape[:-1], -1, 2])
        rotated = paddle.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    else:  # [second half, first half]: one roll, ~2.5x faster than split + concat
        rotated = paddle.roll(x, x.shape[-1] // 2, axis=-1)
    return x * cos + rotated * sin


def _attend(
    q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, g: _Group, kvh: int
) -> paddle.Tensor:
    """q [S*n, H, d] (pre-scaled) of one group against its cache blocks -> [S*n, H*d].

    Query head h reads kv head h // (H / KV) (HF repeat_kv): the group's queries are the
    rows of their kv head's matmul. One gather reads each (sequence, kv head)'s blocks as
    one [nb * block_size, d] operand (the cache's (block, kv head) rows are contiguous
    slots × head_dim), so scores, softmax and the weighted sum are plain batched matmuls
    and last-axis reductions over [S, KV, n*g, keys]: no key or value is transposed.
    Prefill chunks reorder their query and output rows with one gather each (paddle's
    strided copy of a transposed view is ~50x slower than a gather)."""
    s, n = g.seqs, g.new_tokens
    h, d = q.shape[1], q.shape[2]
    gs = h // kvh
    keys = g.num_blocks * k_cache.shape[2]
    row = k_cache.shape[2] * d
    k = paddle.gather(k_cache.reshape([-1, row]), g.kv_rows).reshape([s, kvh, keys, d])
    v = paddle.gather(v_cache.reshape([-1, row]), g.kv_rows).reshape([s, kvh, keys, d])
    if g.q_rows is None:
        q = q.reshape([s, kvh, gs, d])
    else:
        q = paddle.gather(q.reshape([-1, gs * d]), g.q_rows).reshape([s, kvh, n * gs, d])
    # paddle's softmax, not exp / sum: paddle.exp of a masked (-inf) score is a subnormal
    # (2.9e-39) that makes every op after it ~10x slower; softmax gives it ~1e-28 (nothing
    # in float32 next to the visible keys' weights, the largest of which is >= 1 / keys)
    probs = F.softmax(paddle.matmul(q, k, transpose_y=True) + g.mask, axis=-1)
    out = paddle.matmul(probs, v)  # [S, KV, n*g, d]
    if g.out_rows is None:
        return out.reshape([s, h * d])
    return paddle.gather(out.reshape([-1, gs * d]), g.out_rows).reshape([s * n, h * d])
