"""Continuous batching over a paged KV cache: queues, block tables, step plans. Pure.

A sequence is ``tokens`` (prompt + output so far) of which ``num_computed`` have their
K/V in the cache (or in a step sent). Every step feeds each scheduled sequence
``tokens[num_computed:]`` (the whole prompt, a chunk of it, or the one token sampled last
step) and samples from its last position once nothing is left — so prefill, decode and
recompute after a preemption or a weight change are the same operation.

``n`` choices share the prompt's prefill: the request's first sequence prefills once
and rank 0 samples ``n`` tokens from that position; the other choices then fork, sharing
the full prompt blocks (reference counts) and copying the partial last block.

Pipelined steps: while step N is in flight, :meth:`Scheduler.schedule` with ``ahead``
plans step N+1 from what N will leave. ``num_computed`` counts positions sent to the
ranks (advanced when a step is planned), and ``pending`` the tokens a step in flight
samples for the sequence, whose values the engine does not know yet: the next row of
such a sequence ends with that token (``StepRow.prev``: the ranks kept it). A sequence
that N surely ends (``max_tokens``, the context length) is left out; one that N ends on
a stop token has computed one row too many, whose sample :meth:`apply` drops. An ahead
plan never preempts: when blocks run short it returns None and the caller runs the
next step after N's reply instead.

Multi-step decode (``ROLLBUS_DECODE_STEPS``): a step of pure decode rows may ask the
ranks for ``iters`` decode iterations (:meth:`Scheduler.decode_iters` says when, and how
many). Each row then computes ``iters`` positions and samples ``iters`` tokens, so
``num_computed`` advances by ``iters`` at planning and ``pending`` counts all the tokens
the step samples; :meth:`apply` takes them in iteration order, exactly as ``iters``
one-token steps, and a sequence that ends mid-step drops the tokens after its end (its
KV past it is freed with its blocks, never read). Pipelining combines with it unchanged:
the ahead step's ``prev`` row continues after every token the step in flight leaves (the
ranks keep its last iteration's), and ``_ends_ahead`` counts them all.

Fairness: a step's rows are shared among the running requests round-robin, and while
requests wait for admission one request may take at most ``max_batch // (running
requests + 1)`` rows, so one large-``n`` request cannot starve small ones. Within a
request, the sequences stepped least recently go first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine import staleness
from shared import messages as m


def penalties(gen: m.GenRequest) -> m.Penalties | None:
    """The request's penalties for its sample specs; None when they are all off (its
    rows then carry no ``history``: rank 0 does nothing more for them)."""
    if gen.presence_penalty == 0 and gen.frequency_penalty == 0 and gen.repetition_penalty == 1:
        return None
    return m.Penalties(
        gen.presence_penalty, gen.frequency_penalty, gen.repetition_penalty,
        len(gen.prompt_token_ids),
    )  # fmt: skip


def limits(gen: m.GenRequest) -> m.Limits | None:
    """The request's ``min_p`` / ``allowed_token_ids`` for its sample specs; None when it
    has neither (one nil byte per spec)."""
    if gen.min_p == 0 and gen.allowed_token_ids is None:
        return None
    return m.Limits(gen.min_p, gen.allowed_token_ids)


@dataclass(frozen=True)
class BadWords:
    """A request's vLLM ``bad_words`` token sequences, split for its sample specs: the
    single-token ones are banned at every position (the spec's ``ban``), the longer ones
    go to rank 0 with the output's last ``reach`` tokens (``Limits.bad_words`` / ``tail``)."""

    single: list[int]
    multi: list[list[int]]
    reach: int  # the longest multi-token word's length - 1 (0: none)


def bad_words(gen: m.GenRequest) -> BadWords | None:
    if not gen.bad_words:
        return None
    single = list(dict.fromkeys(w[0] for w in gen.bad_words if len(w) == 1))
    multi = [w for w in gen.bad_words if len(w) > 1]
    return BadWords(single, multi, max((len(w) - 1 for w in multi), default=0))


# a step message must fit the NATS server's max_payload (1 MiB by default) or its publish
# fails and every request in the step with it: the sample specs (which repeat a request's
# logit_bias, allowed ids and bad words once per choice) get at most half of it per step
SPEC_BYTES = 512 * 1024
# ... and the whole message counts: each row's block table (one id per KV block, up to
# 3 msgpack bytes below 65536 blocks: a 32k-token context in blocks of 1 is 96 KiB per
# row, of every choice), its token ids, the step's block copies and finished ids
MAX_PAYLOAD = 1 << 20  # nats-server's default, until the engine sets the server's own
STEP_HEADROOM = 2048  # the step's own fields (a version of up to 1 KiB) and its headers
ROW_BYTES = 32  # a row's fields but its lists' items, at most (msgpack)
TOKEN_BYTES = 5  # a token id's msgpack bytes, at most (ids < 2**31)
# rank 0's reply to a step holds every sample of every decode iteration: per sample its
# seq id and token (up to 5 bytes each below 2**32), logprob (a float64: 9), an entry of
# ``top`` (its array header 1, its ids' array header up to 3 — 16 alternatives and more
# are an array16 —, its bytes' header 2: 6, an empty entry 4, when another sample has
# alternatives) and per alternative up to 5 bytes of id and 4 of float32: a step of K
# iterations answers K times the samples
REPLY_SAMPLE_BYTES = 25
REPLY_TOP_BYTES = 9


def reply_bytes(top_logprobs: int, next_seq: int = 0) -> int:
    """An upper bound of the bytes one sample (of a spec asking ``top_logprobs``
    alternatives) takes in rank 0's reply, iteration by iteration, its seq id below
    ``next_seq`` (past 2**32 a uint64: 4 bytes more)."""
    wide = uint_bytes(next_seq) - 5 if next_seq >= 2**32 else 0  # a uint64 seq id
    return REPLY_SAMPLE_BYTES + wide + REPLY_TOP_BYTES * top_logprobs


def uint_bytes(largest: int) -> int:
    """The msgpack bytes of any int in [0, ``largest``]."""
    if largest < 128:
        return 1
    if largest < 256:
        return 2
    return 3 if largest < 65536 else 5 if largest < 2**32 else 9


def spec_bytes(gen: m.GenRequest, bad: BadWords | None) -> int:
    """An upper bound of the bytes one sample spec of ``gen`` takes in a step message:
    128 KiB with a long ``bad_words`` list, a few dozen bytes for most requests. Every
    field counts: ``min_tokens`` alone holds up to 272 stop ids (five bytes each) back."""
    multi = bad.multi if bad is not None else None
    tail = [m.TOKEN_LIMIT] * bad.reach if bad is not None else None  # ids up to 5 bytes
    stops = gen.stop_token_ids if gen.min_tokens else ()
    ban = [*stops, *(bad.single if bad is not None else ())] or None
    spec = m.SamplingSpec(
        m.TOKEN_LIMIT, gen.temperature, gen.top_p, gen.top_k, m.INT64_MIN, m.TOKEN_LIMIT,
        gen.logprobs, gen.top_logprobs, gen.logit_bias, ban, penalties(gen),
        m.Limits(gen.min_p, gen.allowed_token_ids, multi or None, tail),
    )  # fmt: skip
    return len(m.pack(spec)) + 16


def heaviest(gen: m.GenRequest, bad: BadWords | None) -> str:
    """The field that takes most of ``gen``'s sample specs (the 400's ``param``)."""
    ids = 5  # bytes of a token id at most
    return max(
        ("bad_words", len(m.pack(bad.multi)) + ids * (len(bad.single) + bad.reach) if bad else 0),
        ("allowed_token_ids", ids * len(gen.allowed_token_ids or ())),
        ("logit_bias", len(m.pack(gen.logit_bias)) if gen.logit_bias else 0),
        ("stop_token_ids", ids * len(gen.stop_token_ids) if gen.min_tokens else 0),
        key=lambda kv: kv[1],
    )[0]


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        b = self.free.popleft()
        self.refs[b] = 1
        return b

    def share(self, b: int) -> int:
        self.refs[b] += 1
        return b

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
        blocks.clear()

    def reset(self) -> None:
        self.free = deque(range(self.num_blocks))
        self.refs = [0] * self.num_blocks


# eq=False on Request and Seq: one is the same as another only if it is that one (the
# field-by-field ``__eq__`` a dataclass gets made every ``seq in self.running`` of a
# step's plan cost ~240 tuple compares at 16 rows, the plan's largest cost)
@dataclass(eq=False)
class Request:
    gen: m.GenRequest
    reply: str
    seqs: list[Seq] = field(default_factory=list)
    forked: bool = False
    started: bool = False  # scheduled once: no longer counts against the waiting limit
    penalties: m.Penalties | None = None  # its sample specs' (see ``penalties``)
    limits: m.Limits | None = None  # its sample specs' (see ``limits``)
    bad: BadWords | None = None  # its bad_words (see ``bad_words``)
    spec_bytes: int = 64  # of one of its sample specs in a step message (``spec_bytes``)
    # the most bytes any row of it may take (``Scheduler.largest_row``): while a step has
    # that much room left, its rows' own costs need no computing (``_row_cost``)
    max_row: int = 0

    @property
    def request_id(self) -> str:
        return self.gen.request_id


@dataclass(eq=False)
class Seq:
    seq_id: int
    req: Request
    index: int
    tokens: list[int]
    prompt_len: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[m.VersionSpan] = field(default_factory=list)
    finish_reason: str | None = None
    last_step: int = 0
    pending: int = 0  # tokens sampled by steps in flight, not yet applied
    # (min_tokens' ban on, the spec) of its last decode row: sent again while the same
    # (never changed once built: a step in flight may still hold it)
    spec: tuple[bool, m.SamplingSpec] | None = None

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def length(self) -> int:
        """Tokens once the steps in flight are applied (known + ``pending``)."""
        return len(self.tokens) + self.pending

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def add_token(self, token: int, logprob: float, version: str) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        n = self.output_len
        if self.spans and self.spans[-1].version == version:
            self.spans[-1].end = n
        else:
            self.spans.append(m.VersionSpan(version, n - 1, n))


@dataclass
class Output:
    """What one step produced for a sequence: a token, and maybe its end."""

    seq: Seq
    token: int | None
    logprob: float | None
    finish_reason: str | None
    error: tuple[int, str] | None = None  # (code, why): this request failed alone
    top: m.TopLogprobs | None = None  # the alternatives, when the request asked for them


@dataclass
class Plan:
    step: m.StepRequest
    seqs: list[Seq]  # row order


class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_batch: int,
        max_step_tokens: int,
        max_model_len: int,
    ) -> None:
        self.alloc = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.max_model_len = max_model_len
        self.max_spec_bytes = SPEC_BYTES  # per step (``fit``: from the server's max_payload)
        self.max_step_bytes = MAX_PAYLOAD - STEP_HEADROOM  # a step message's, all in
        self.id_bytes = uint_bytes(num_blocks - 1)  # of a block id in a block table
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.requests: dict[str, Request] = {}
        self._next_seq = 0
        self._step = 0
        self._copies: list[tuple[int, int]] = []
        self._finished_ids: list[int] = []
        self.preemptions = 0

    def fit(self, max_payload: int) -> None:
        """Plan steps for a server whose messages carry at most ``max_payload`` bytes."""
        self.max_spec_bytes = max_payload // 2
        self.max_step_bytes = max_payload - STEP_HEADROOM

    @property
    def max_row_bytes(self) -> int:
        """The most a row may take: what a step has left once a quarter is kept for its
        block copies and finished ids, so that a row this large always fits a step alone.
        Finished ids take at most an eighth (``_step_extras``); a copy (at most 11 bytes)
        is one choice forked from a row whose sample specs (73 bytes each at least) took at
        most half of the step before: less than 8% of a message."""
        return self.max_step_bytes * 3 // 4

    @property
    def max_reply_bytes(self) -> int:
        """The samples' bytes a step's reply may hold (``reply_bytes`` each): past the
        server's max_payload rank 0 cannot publish it and the whole step fails; a quarter
        is left for its header and ``failed`` (their messages)."""
        return self.max_step_bytes * 3 // 4

    def row_bytes(self, tokens: int, blocks: int, specs: int) -> int:
        """An upper bound of a step row's msgpack bytes: ``tokens`` new token ids, a block
        table of ``blocks`` ids, ``specs`` bytes of sample specs."""
        return ROW_BYTES + TOKEN_BYTES * tokens + self.id_bytes * blocks + specs

    # ------------------------------------------------------------------ admission

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def check(self, gen: m.GenRequest) -> tuple[str, str] | None:
        """``(why, param)`` when ``gen`` can never run (None when it can): ``prompt`` when
        the prompt alone does not fit, else ``max_tokens``."""
        prompt = len(gen.prompt_token_ids)
        total = prompt + gen.max_tokens
        if not prompt:
            return "prompt is empty", "prompt"
        param = "prompt" if prompt > self.max_model_len else "max_tokens"
        if total > self.max_model_len:
            return (
                f"prompt ({prompt} tokens) + max_tokens ({gen.max_tokens}) "
                f"exceeds the maximum context length {self.max_model_len}"
            ), param
        if self.blocks_for(total) > self.alloc.num_blocks:
            if self.blocks_for(prompt) > self.alloc.num_blocks:
                param = "prompt"
            return (
                f"needs {self.blocks_for(total)} KV blocks, the cache has {self.alloc.num_blocks}"
            ), param
        bad = bad_words(gen)
        size = gen.n * spec_bytes(gen, bad)
        if size > self.max_spec_bytes:  # its prefill row alone carries all n specs
            heavy = heaviest(gen, bad)
            return (
                f"n ({gen.n}) x the sampling data of one choice (bad_words, allowed_token_ids, "
                f"logit_bias, stop_token_ids under min_tokens) is {size} bytes per step, more "
                f"than a step message carries ({self.max_spec_bytes}): ask fewer choices or "
                "less data"
            ), heavy
        answer = gen.n * reply_bytes(gen.top_logprobs, self._next_seq + gen.n)
        if answer > self.max_reply_bytes:  # its prefill row alone samples all n choices
            return (
                f"n ({gen.n}) x top_logprobs ({gen.top_logprobs}) alternatives is up to {answer} "
                f"bytes of a step's reply, more than it carries ({self.max_reply_bytes} of the "
                "server's max_payload): ask fewer choices or fewer top_logprobs"
            ), "top_logprobs" if gen.top_logprobs else "n"
        return self._check_rows(gen, spec_bytes(gen, bad))

    def _check_rows(self, gen: m.GenRequest, spec: int) -> tuple[str, str] | None:
        """``(why, param)`` when a row of ``gen`` alone would not fit a step message: its
        block table (a KV block id per ``KV_BLOCK_SIZE`` tokens of its context) with its
        token ids and sample specs. The largest rows: the prompt's last chunk, which
        samples for all ``n`` choices, and a choice's recompute at its longest."""
        prompt = len(gen.prompt_token_ids)
        total = prompt + gen.max_tokens
        chunk = min(prompt, self.max_step_tokens)
        first = self.row_bytes(chunk, self.blocks_for(prompt), gen.n * spec)
        last = self.row_bytes(min(total, self.max_step_tokens), self.blocks_for(total), spec)
        limit = self.max_row_bytes
        if max(first, last) <= limit:
            return None
        if self.row_bytes(chunk, self.blocks_for(prompt), spec) > limit:
            param = "prompt"
        else:
            param = "n" if first > limit else "max_tokens"
        blocks = self.blocks_for(prompt if first > last else total)
        return (
            f"a step row of this request takes up to {max(first, last)} bytes (a block table "
            f"of {blocks} KV block ids of {self.id_bytes} bytes, its token ids and sampling "
            f"data), more than a step message carries ({limit} of the server's max_payload): "
            "ask a shorter prompt, fewer max_tokens or fewer choices, or serve with a larger "
            "ROLLBUS_KV_BLOCK_SIZE"
        ), param

    def largest_row(self, gen: m.GenRequest, spec: int) -> int:
        """An upper bound of ``_row_cost`` for every row of ``gen``: at most a step's
        tokens, the block table of its whole context, every choice's sample spec."""
        total = len(gen.prompt_token_ids) + gen.max_tokens
        tokens = min(total, self.max_step_tokens)
        return self.row_bytes(tokens, self.blocks_for(total), max(1, gen.n) * spec)

    def add(self, gen: m.GenRequest, reply: str) -> Request:
        bad = bad_words(gen)
        spec = spec_bytes(gen, bad)
        req = Request(
            gen, reply, penalties=penalties(gen), limits=limits(gen), bad=bad,
            spec_bytes=spec, max_row=self.largest_row(gen, spec),
        )  # fmt: skip
        prompt = list(gen.prompt_token_ids)
        for i in range(max(1, gen.n)):
            req.seqs.append(Seq(self._next_seq, req, i, list(prompt), len(prompt)))
            self._next_seq += 1
        self.requests[gen.request_id] = req
        self.waiting.append(req.seqs[0])  # the others fork after the shared prefill
        return req

    @property
    def num_live(self) -> int:
        return len(self.requests)

    @property
    def num_queued(self) -> int:
        """Requests not yet admitted to a step (what ``ROLLBUS_MAX_WAITING`` bounds)."""
        return sum(1 for r in self.requests.values() if not r.started)

    # ------------------------------------------------------------------ planning

    def _ensure_blocks(self, seq: Seq, upto: int) -> bool:
        need = self.blocks_for(upto) - len(seq.blocks)
        if need > self.alloc.num_free:
            return False
        for _ in range(need):
            seq.blocks.append(self.alloc.take())
        return True

    def _preempt(self, seq: Seq) -> None:
        """Recompute-preemption: drop its KV, requeue it at the front."""
        self.alloc.release(seq.blocks)
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _row(self, seq: Seq, budget: int) -> m.StepRow:
        remaining = seq.length - seq.num_computed
        chunk = min(remaining, budget)
        new = seq.tokens[seq.num_computed : seq.num_computed + chunk]
        prev = len(new) < chunk  # the last position is the token a step in flight samples
        sample: list[m.SamplingSpec] = []
        if chunk == remaining:
            req = seq.req
            # the prompt's one sample position serves every choice (until they fork)
            first = seq.index == 0 and not req.forked and seq.length == seq.prompt_len
            if first or req.bad is not None:
                targets = req.seqs if first else [seq]
                sample = [self._spec(t) for t in targets]
                if req.bad is not None:
                    for spec, t in zip(sample, targets, strict=True):
                        self._bad_words(spec, t, req.bad)
            else:
                # a decode row's spec is the one of its row before unless min_tokens' ban
                # just ended (bad words' tail changes every token: built afresh above)
                banned = seq.length - seq.prompt_len < req.gen.min_tokens
                if seq.spec is None or seq.spec[0] != banned:
                    seq.spec = (banned, self._spec(seq))
                sample = [seq.spec[1]]
        history = seq.req.penalties is not None  # rank 0 records this sequence's tokens
        return m.StepRow(seq.seq_id, new, seq.num_computed, list(seq.blocks), sample, prev, history)

    @staticmethod
    def _spec(t: Seq) -> m.SamplingSpec:
        """How rank 0 samples ``t``'s next token (a new struct: ``_bad_words`` adds to it)."""
        req = t.req
        g = req.gen
        return m.SamplingSpec(
            t.seq_id, g.temperature, g.top_p, g.top_k, g.seed, t.index, g.logprobs,
            g.top_logprobs, g.logit_bias,
            # min_tokens: no stop id before the minimum (this samples output index
            # t.length - t.prompt_len)
            g.stop_token_ids or None if t.length - t.prompt_len < g.min_tokens else None,
            req.penalties,
            req.limits,
        )  # fmt: skip

    @staticmethod
    def _samples(seq: Seq) -> int:
        """The most samples a row of ``seq`` may ask: the first sequence of a request not
        forked yet samples for every choice."""
        req = seq.req
        return len(req.seqs) if seq.index == 0 and not req.forked else 1

    def _spec_cost(self, seq: Seq) -> int:
        """The most bytes of sample specs a row of ``seq`` may carry."""
        return seq.req.spec_bytes * self._samples(seq)

    def _reply_cost(self, seq: Seq) -> int:
        """The most bytes a row of ``seq`` may add to the step's reply (one iteration)."""
        return reply_bytes(seq.req.gen.top_logprobs, self._next_seq) * self._samples(seq)

    def _row_cost(self, seq: Seq, budget: int) -> int:
        """The most bytes ``seq``'s next row may take (before its blocks are taken), with
        ``budget`` tokens left in the step."""
        upto = min(seq.length, seq.num_computed + budget)
        blocks = max(len(seq.blocks), self.blocks_for(upto))
        return self.row_bytes(upto - seq.num_computed, blocks, self._spec_cost(seq))

    def _no_room(self, seq: Seq, budget: int, room: int, said: int, space: int) -> bool:
        """Whether ``seq``'s next row would pass what the step has left: ``room`` bytes of
        sample specs, ``said`` bytes of rank 0's reply, ``space`` bytes of the message
        (``budget`` tokens left)."""
        return (
            self._spec_cost(seq) > room
            or self._reply_cost(seq) > said
            # its request's largest row first: a short one's costs a comparison, not
            # ``_row_cost`` (a microsecond a row: a third of a 16-row step's planning)
            or (seq.req.max_row > space and self._row_cost(seq, budget) > space)
        )

    def _sent_cost(self, row: m.StepRow, seq: Seq) -> int:
        """The bytes ``row`` (of ``seq``) is counted for in its step."""
        specs = len(row.sample) * seq.req.spec_bytes
        return self.row_bytes(len(row.token_ids), len(row.block_table), specs)

    def _step_extras(self) -> tuple[int, int]:
        """``(finished ids this step carries, bytes of them and of the block copies)``:
        finished ids past an eighth of the message wait for the next step (thousands end
        at once on a pause that aborts; a rank only forgets their samplers later)."""
        per = uint_bytes(self._next_seq)
        keep = min(len(self._finished_ids), self.max_step_bytes // 8 // per)
        return keep, per * keep + (1 + 2 * self.id_bytes) * len(self._copies)

    @staticmethod
    def _bad_words(spec: m.SamplingSpec, seq: Seq, bad: BadWords) -> None:
        """``spec`` (of ``seq``) with its request's bad words: the single-token ones join
        its ban, the longer ones go with the output's last tokens known here (a token a
        step in flight samples is added by rank 0, which has it)."""
        if bad.single:
            spec.ban = [*(spec.ban or ()), *bad.single]
        if bad.multi:
            g = seq.req.gen
            tail = seq.tokens[max(seq.prompt_len, len(seq.tokens) - bad.reach) :]
            spec.limits = m.Limits(g.min_p, g.allowed_token_ids, bad.multi, tail)

    def _fair_order(self, admitting: bool) -> list[Seq]:
        """Running sequences in the order they get rows: round-robin over requests,
        least recently stepped first within one; while others wait for admission, one
        request gets at most half the rows."""
        by_req: dict[str, list[Seq]] = {}
        for seq in self.running:
            by_req.setdefault(seq.req.request_id, []).append(seq)
        cap = self.max_batch
        if admitting and len(by_req) < self.max_batch:
            cap = max(1, self.max_batch // (len(by_req) + 1))
        queues = [sorted(q, key=lambda s: s.last_step)[:cap] for q in by_req.values()]
        order: list[Seq] = []
        for i in range(max((len(q) for q in queues), default=0)):
            order += [q[i] for q in queues if i < len(q)]
        return order

    def held(self, behind: int, max_staleness: int | None) -> int:
        """Requests that may not start now: ``behind`` versions is over their staleness
        bound (``max_staleness``, the setting, or their own, whichever is stricter)."""
        return sum(
            1
            for r in self.requests.values()
            if not r.started and staleness.holds(behind, max_staleness, r.gen.max_staleness)
        )

    @staticmethod
    def _may_start(seq: Seq, behind: int, max_staleness: int | None) -> bool:
        """A waiting sequence may be admitted: a started one (preempted, forked) always,
        a new one while within its staleness bound."""
        req = seq.req
        return req.started or not staleness.holds(behind, max_staleness, req.gen.max_staleness)

    def _ends_ahead(self, seq: Seq) -> bool:
        """A step in flight surely ends ``seq`` (its last token reaches ``max_tokens`` or
        the context length): it gets no row after that step."""
        if not seq.pending:
            return False
        out = seq.length - seq.prompt_len
        return out >= seq.req.gen.max_tokens or seq.length >= self.max_model_len

    def schedule(
        self,
        *,
        admit: bool = True,
        run: bool = True,
        behind: int = 0,
        max_staleness: int | None = None,
        ahead: bool = False,
        steps: int = 1,
    ) -> Plan | None:
        """The next step, or None when there is nothing to do.

        Nothing at all is sent while ``run`` is off (paused or asleep): pending block
        copies and finished ids wait for the next real step, since the ranks may have
        freed their KV cache meanwhile. ``behind`` (versions the serving one is behind the
        newest announced) and ``max_staleness``: a request that has not started yet and is
        over its bound stays in the queue (see :mod:`services.engine.staleness`).

        ``ahead``: a step is in flight and this one follows it (see the module doc); None
        also when it would have to preempt or has no row.

        ``steps``: decode iterations the step may ask for (``ROLLBUS_DECODE_STEPS``; the
        caller passes 1 while a control call waits for the step lock); see
        :meth:`decode_iters` for how many it gets."""
        if not run:
            return None
        rows: list[m.StepRow] = []
        seqs: list[Seq] = []
        costs: list[int] = []  # each row's bytes (``_sent_cost``)
        budget = self.max_step_tokens
        room = self.max_spec_bytes  # sample specs' bytes (a row that would pass it waits)
        said = self.max_reply_bytes  # rank 0's reply's bytes of samples (the same rule)
        keep, extras = self._step_extras()
        space = self.max_step_bytes - extras  # the whole message's bytes (rows too)
        admitting = admit and any(self._may_start(s, behind, max_staleness) for s in self.waiting)
        for seq in self._fair_order(admitting):
            if seq not in self.running or len(rows) >= self.max_batch or budget <= 0:
                continue
            if self._ends_ahead(seq):
                continue
            if rows and self._no_room(seq, budget, room, said, space):
                # the next step: only the rows of sequences running before it, which all
                # end, can keep taking its room (a request that starts later runs after it)
                continue
            upto = min(seq.length, seq.num_computed + budget)
            if ahead and not self._ensure_blocks(seq, upto):
                return None  # preempting a sequence in flight: not while a step runs
            while not self._ensure_blocks(seq, upto):
                victim = self.running[-1]
                self._preempt(victim)
                had = [i for i, q in enumerate(seqs) if q is victim]
                for i in had:  # it had a row in this step already: not any more
                    budget += rows[i].num_new
                    room += len(rows[i].sample) * victim.req.spec_bytes
                    said += len(rows[i].sample) * reply_bytes(
                        victim.req.gen.top_logprobs, self._next_seq
                    )
                    space += costs[i]
                    del rows[i], seqs[i], costs[i]
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            row = self._row(seq, budget)
            budget -= row.num_new
            room -= len(row.sample) * seq.req.spec_bytes
            said -= len(row.sample) * reply_bytes(seq.req.gen.top_logprobs, self._next_seq)
            costs.append(self._sent_cost(row, seq))
            space -= costs[-1]
            rows.append(row)
            seqs.append(seq)
        ready = [s for s in self.waiting if self._may_start(s, behind, max_staleness)]
        for seq in ready if admit else []:
            if len(rows) >= self.max_batch or budget <= 0:
                break
            if rows and self._no_room(seq, budget, room, said, space):
                # the next step (``check``: a row of it fits alone); none queued behind it
                # starts before it (a stream of smaller ones kept it waiting for ever)
                break
            upto = min(seq.length, seq.num_computed + budget)
            if not self._ensure_blocks(seq, upto):
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.req.started = True
            row = self._row(seq, budget)
            budget -= row.num_new
            room -= len(row.sample) * seq.req.spec_bytes
            said -= len(row.sample) * reply_bytes(seq.req.gen.top_logprobs, self._next_seq)
            costs.append(self._sent_cost(row, seq))
            space -= costs[-1]
            rows.append(row)
            seqs.append(seq)
        # finished ids alone are no step: they go with the next one (a rank only drops
        # their samplers), so the end of a batch costs no round trip of its own
        if not rows and (ahead or not self._copies):
            return None
        iters = self.decode_iters(rows, seqs, steps, space) if steps > 1 and rows else 1
        self._step += 1
        for row, seq in zip(rows, seqs, strict=True):
            seq.last_step = self._step
            # sent: the next row starts after it (and the positions the later iterations
            # feed: the tokens the iterations before them sampled)
            seq.num_computed += row.num_new + iters - 1
            if row.sample:
                seq.pending += iters
        step = m.StepRequest(self._step, rows, self._copies, self._finished_ids[:keep], iters=iters)
        self._copies, self._finished_ids = [], self._finished_ids[keep:]
        return Plan(step, seqs)

    def decode_iters(
        self, rows: list[m.StepRow], seqs: list[Seq], most: int, space: int = 1 << 62
    ) -> int:
        """How many decode iterations (1..``most``) a step of ``rows`` runs; the KV blocks
        of the positions they add are taken here. More than 1 only when every row is a
        decode row (one new token, one sample spec: its own) whose spec stays the same
        token after token: no ``bad_words`` (their tail changes), and a ``min_tokens``
        ban only while it lasts through the window. No row's iterations go past its
        ``max_tokens`` or the context length, so the fewest tokens any row has left bound
        all; and the iterations are cut to what the free blocks hold (never a
        preemption for them), and to what the step message has ``space`` for: every block
        added to a row's table is at most 5 more bytes (a msgpack uint32), and its
        array header at most 4 more; and to what rank 0's reply has room for (``fit``'s
        max_payload: a reply past it is not published, and the whole step fails), each
        iteration adding its samples and their top alternatives (``reply_bytes``)."""
        k = most
        for row, seq in zip(rows, seqs, strict=True):
            spec = row.sample[0] if len(row.sample) == 1 else None
            if spec is None or row.num_new != 1 or spec.seq_id != seq.seq_id:
                return 1  # a prefill (chunk), a mid-prefill row, a prompt sampled for n
            if seq.req.bad is not None:
                return 1
            g = seq.req.gen
            out = seq.length - seq.prompt_len  # the output index iteration 0 samples
            k = min(k, g.max_tokens - out, self.max_model_len - seq.length)
            if out < g.min_tokens:  # banned: the ban must hold for every iteration
                k = min(k, g.min_tokens - out)
            elif spec.ban:
                return 1
        per = sum(reply_bytes(r.sample[0].top_logprobs, self._next_seq) for r in rows)
        k = min(k, self.max_reply_bytes // per)
        while k > 1:
            need = sum(
                max(0, self.blocks_for(seq.length + k - 1) - len(seq.blocks)) for seq in seqs
            )
            grown = 5 * need + 4 * len(rows)
            if need <= self.alloc.num_free and (need == 0 or grown <= space):
                for row, seq in zip(rows, seqs, strict=True):
                    if self._ensure_blocks(seq, seq.length + k - 1):
                        row.block_table = list(seq.blocks)
                return k
            k -= 1
        return 1

    # ------------------------------------------------------------------ results

    def apply(self, plan: Plan, reply: m.StepReply, version: str) -> list[Output]:
        """The reply of ``plan`` (steps are applied in the order they were planned);
        ``version``: the weights it ran on."""
        for row, seq in zip(plan.step.rows, plan.seqs, strict=True):
            if row.sample:
                seq.pending -= plan.step.iters
        by_id = {s.seq_id: s for row_seq in plan.seqs for s in row_seq.req.seqs}
        tops: list[m.TopLogprobs | None] = list(reply.top) or [None] * len(reply.seq_ids)
        samples = [
            (by_id[sid], tok, lp, top)
            for sid, tok, lp, top in zip(
                reply.seq_ids, reply.tokens, reply.logprobs, tops, strict=True
            )
            if sid in by_id
        ]
        # fork first: the leader may finish on this very token and release its blocks
        for seq, _, _, _ in samples:
            req = seq.req
            if not req.forked and seq is req.seqs[0]:
                for child in req.seqs[1:]:
                    if child.finish_reason is None:
                        self._fork(seq, child)
                req.forked = True
        outputs = self._fail(reply.failed, by_id)
        for seq, token, logprob, top in samples:
            if seq.finish_reason is not None:
                continue  # ended meanwhile
            seq.add_token(token, logprob, version)
            reason = self._finish_reason(seq, token)
            outputs.append(Output(seq, token, logprob, reason, top=top))
            if reason:
                self.finish(seq, reason)
        return outputs

    def _fail(self, failed: list[tuple[int, int, str]], by_id: dict[int, Seq]) -> list[Output]:
        """End the requests whose sampling failed on the rank; the others go on."""
        outputs: list[Output] = []
        for sid, code, why in failed:
            seq = by_id.get(sid)
            if seq is None or seq.finish_reason is not None:
                continue  # a row computed past its end (pipelined): its sample is dropped
            for s in seq.req.seqs:
                if s.finish_reason is None:
                    self.finish(s, "error")
                    outputs.append(Output(s, None, None, "error", (code, why)))
        return outputs

    def _fork(self, leader: Seq, child: Seq) -> None:
        """``child`` takes the leader's prompt KV: full blocks shared, last one copied."""
        # the prompt's positions (the leader's row after it may be in flight already)
        computed = leader.prompt_len
        full = computed // self.block_size
        child.blocks = [self.alloc.share(b) for b in leader.blocks[:full]]
        if computed % self.block_size:
            if self.alloc.num_free == 0:  # no room to copy: recompute its prompt later
                self.alloc.release(child.blocks)
                child.num_computed = 0
                self.waiting.appendleft(child)
                return
            dst = self.alloc.take()
            self._copies.append((leader.blocks[full], dst))
            child.blocks.append(dst)
        child.num_computed = computed
        self.running.append(child)

    def _finish_reason(self, seq: Seq, token: int) -> str | None:
        g = seq.req.gen
        if token in g.stop_token_ids:
            return "stop"
        if seq.output_len >= g.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Seq, reason: str) -> None:
        seq.finish_reason = reason
        self.alloc.release(seq.blocks)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finished_ids.append(seq.seq_id)
        req = seq.req
        if all(s.finish_reason is not None for s in req.seqs):
            self.requests.pop(req.request_id, None)

    # ------------------------------------------------------------------ control

    def abort(self, request_id: str | None = None, reason: str = "abort") -> list[Seq]:
        """End every live sequence (of one request, or all) with ``reason``."""
        reqs = (
            [self.requests[request_id]]
            if request_id in self.requests
            else ([] if request_id else list(self.requests.values()))
        )
        ended = []
        for req in reqs:
            for seq in req.seqs:
                if seq.finish_reason is None:
                    self.finish(seq, reason)
                    ended.append(seq)
        return ended

    def recompute_all(self) -> None:
        """Drop every running sequence's KV (weights changed or KV freed); they re-prefill
        prompt + output so far when scheduled again, in their original order."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)
        self._copies = []

    def reset_blocks(self) -> None:
        self.recompute_all()
        self.alloc.reset()

    def counts(self) -> dict[str, int]:
        return {
            "queued": self.num_queued,
            "waiting": len(self.waiting),
            "running": len(self.running),
            "requests": len(self.requests),
            "free_blocks": self.alloc.num_free,
            "preemptions": self.preemptions,
        }
