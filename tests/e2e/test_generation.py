"""Generation through a real stack with the official `openai` client, and what every
control method does to running requests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from services.tiny_model import write_version
from tests.e2e.reference import greedy
from tests.e2e.stack import Stack

PROMPT = "The rollout"


@pytest.fixture(scope="module", autouse=True)
def _v1(stack: Stack) -> None:
    """Version v1 in the model dir (the session's shared stack, see conftest; test_control
    writes the same one)."""
    write_version(stack.model_dir, "v1", seed=1)


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0)


class _AsyncClients:
    """A fresh AsyncOpenAI per event loop (each test runs its own ``asyncio.run``)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    @property
    def completions(self) -> Any:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="x", max_retries=0).completions


@pytest.fixture
def aclient(stack: Stack) -> Any:
    return _AsyncClients(stack.base_url + "/v1")


def ctl(stack: Stack, path: str, **kw: Any) -> httpx.Response:
    with stack.client() as c:
        return c.post(path, **kw)


@pytest.fixture(autouse=True)
def running_at_v0(stack: Stack) -> Iterator[None]:
    yield
    st = stack.status()
    if st["state"] == "sleeping":
        ctl(stack, "/v1/wakeup")
    if stack.status()["weight_version"] != "v0":
        ctl(stack, "/v1/pause")
        assert ctl(stack, "/v1/update_weights", json={"version": "v0"}).status_code == 200
    ctl(stack, "/v1/resume")
    assert stack.status()["state"] == "running"


def prompt_ids(text: str = PROMPT) -> list[int]:
    return [256, *text.encode()]  # the byte tokenizer: <bos> then the UTF-8 bytes


def test_models_lists_max_model_len(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [x.id for x in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 2048


def test_completion_and_chat(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(prompt_ids()) and r.usage.completion_tokens <= 8
    assert r.model_extra["weight_version"] == "v0"
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
    )
    assert c.choices[0].message.role == "assistant"
    assert c.model_extra["weight_version"] == "v0"
    lps = c.choices[0].logprobs.content
    assert len(lps) == c.usage.completion_tokens and all(x.logprob <= 0 for x in lps)


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.model_extra["weight_version"] == "v0" for ch in chunks)
    toks = [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]]
    assert toks == full.choices[0].model_extra["token_ids"]
    # chat stream: role first, [DONE] handled by the client, usage chunk when asked
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=5,
        stream=True,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].usage.completion_tokens == 5


def test_greedy_is_deterministic_and_equals_tp1_reference(
    stack: Stack, client: openai.OpenAI
) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ta, tb = a.choices[0].model_extra["token_ids"], b.choices[0].model_extra["token_ids"]
    assert ta == tb and len(ta) == 24
    assert a.model_extra["prompt_token_ids"] == prompt_ids()
    assert ta == greedy(stack.model_dir, prompt_ids(), 24)  # tp=2 stack vs tp=1 in-process


def test_n_samples_and_seeds(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=1.0,
        n=4,
        seed=7,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    r = client.completions.create(**kw)
    toks = [c.model_extra["token_ids"] for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({tuple(t) for t in toks}) == 4  # the choices differ
    assert r.usage.completion_tokens == 40
    again = client.completions.create(**kw)
    assert [c.model_extra["token_ids"] for c in again.choices] == toks  # seeded: reproducible


def test_stop_string(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model="tiny", prompt="0123", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    stop = next(
        (
            text[i : i + 2]
            for i in range(5, len(text) - 2)
            if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
        ),
        None,
    )
    if stop is None:
        pytest.skip("greedy text has no clean two-character stop candidate")
    r = client.completions.create(
        model="tiny",
        prompt="0123",
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.find(stop)]


def _token_id(label: str) -> int:
    assert label.startswith("token_id:"), label
    return int(label.removeprefix("token_id:"))


def test_top_logprobs_of_completions_chat_and_streams(client: openai.OpenAI) -> None:
    k = 5
    kw: dict[str, Any] = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=k,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "return_tokens_as_token_ids": True},
    )  # fmt: skip
    r = client.completions.create(**kw)
    c = r.choices[0]
    ids, lp = c.model_extra["token_ids"], c.logprobs
    assert [_token_id(t) for t in lp.tokens] == ids and len(lp.top_logprobs) == 8
    for tok, chosen, alts in zip(ids, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(alts) == k  # greedy: the sampled token is the first alternative
        ranked = sorted(alts.items(), key=lambda kv: -kv[1])
        assert _token_id(ranked[0][0]) == tok and ranked[0][1] == chosen
        assert all(v <= 0 for v in alts.values())
    # the same in a stream, chunk by chunk
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [a for ch in chunks if ch.choices[0].logprobs
                for a in ch.choices[0].logprobs.top_logprobs]  # fmt: skip
    assert streamed == lp.top_logprobs
    offsets = [o for ch in chunks if ch.choices[0].logprobs
               for o in ch.choices[0].logprobs.text_offset]  # fmt: skip
    assert offsets == lp.text_offset  # counted across the chunks of the choice
    # raw logprobs (vLLM's default): the first position's distribution does not depend
    # on the temperature the request samples with
    hot = client.completions.create(**{**kw, "temperature": 2.0, "seed": 3})
    first = hot.choices[0].logprobs.top_logprobs[0]
    assert all(first[t] == pytest.approx(v, abs=1e-6) for t, v in lp.top_logprobs[0].items())
    # chat: logprobs true, top_logprobs k; in a stream too
    chat_kw: dict[str, Any] = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = client.chat.completions.create(**chat_kw).choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        alts = entry.top_logprobs
        assert len(alts) == 3 and alts[0].token == entry.token
        assert alts[0].logprob == entry.logprob and alts[0].bytes == entry.bytes
        assert [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
    parts = list(client.chat.completions.create(stream=True, **chat_kw))
    streamed_chat = [e for p in parts if p.choices and p.choices[0].logprobs
                     for e in p.choices[0].logprobs.content]  # fmt: skip
    assert [e.model_dump() for e in streamed_chat] == [e.model_dump() for e in content]


def test_top_logprobs_in_a_step_shared_with_requests_that_ask_none(stack: Stack) -> None:
    """Requests queued while paused start in the same steps: the one asking for
    alternatives gets them at every position, the others none, all the same tokens."""
    body = {"model": "tiny", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    asks = [None, 3, 0, None]
    bodies = [
        {**body, "prompt": f"{PROMPT} {i}", **({} if k is None else {"logprobs": k})}
        for i, k in enumerate(asks)
    ]
    alone = []
    with stack.client(timeout=120) as c:
        for b in bodies:
            alone.append(c.post("/v1/completions", json=b).json()["choices"][0])
    assert ctl(stack, "/v1/pause", params={"mode": "keep"}).status_code == 200

    def post(b: dict[str, Any]) -> dict[str, Any]:
        with stack.client(timeout=120) as c:
            r = c.post("/v1/completions", json=b)
        assert r.status_code == 200, r.text
        return dict(r.json()["choices"][0])

    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(post, b) for b in bodies]
        deadline = time.monotonic() + 30
        while stack.status()["queued"] < len(bodies) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl(stack, "/v1/resume").status_code == 200
        together = [f.result() for f in futures]
    for k, one, both in zip(asks, alone, together, strict=True):
        assert both["token_ids"] == one["token_ids"]
        if k is None:
            assert both["logprobs"] is None
        else:  # the same, up to float noise of another batch shape
            tops, ref = both["logprobs"]["top_logprobs"], one["logprobs"]["top_logprobs"]
            assert [set(d) for d in tops] == [set(d) for d in ref]
            assert all(len(d) == max(k, 1) for d in tops)
            for d, r in zip(tops, ref, strict=True):
                assert all(d[t] == pytest.approx(v, abs=1e-4) for t, v in r.items())


def test_top_logprobs_beyond_20_are_400_naming_the_field(stack: Stack) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    with stack.client() as c:
        for path, body, param in (
            ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
            ("/v1/chat/completions", {**chat, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": 2},
             "top_logprobs"),
        ):  # fmt: skip
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_list_of_prompts_indexes_choices_as_openai(client: openai.OpenAI) -> None:
    prompts = [f"{PROMPT} {i}" for i in range(3)]
    kw: dict[str, Any] = dict(
        model="tiny",
        max_tokens=6,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == list(range(6))  # prompt_index * n + j
    for i, one in enumerate(alone):
        for j in range(2):
            c = r.choices[i * 2 + j]
            assert c.model_extra["token_ids"] == one.choices[j].model_extra["token_ids"]
            assert c.text == one.choices[j].text
            assert c.model_extra["prompt_token_ids"] == prompt_ids(prompts[i])
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 36
    # token-id lists, streamed: every chunk names its choice
    stream = client.completions.create(
        prompt=[prompt_ids(p) for p in prompts], stream=True,
        stream_options={"include_usage": True}, **kw,
    )  # fmt: skip
    toks: dict[int, list[int]] = {}
    finished, usage = set(), None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            toks.setdefault(c.index, []).extend(c.model_extra.get("token_ids") or [])
            if c.finish_reason:
                finished.add(c.index)
    assert finished == set(range(6)) and usage is not None and usage.completion_tokens == 36
    assert [toks[i] for i in range(6)] == [c.model_extra["token_ids"] for c in r.choices]


def test_stop_token_ids_end_a_choice(client: openai.OpenAI) -> None:
    # seeded sampling: reproducible, and unlike the tiny model's greedy text not a loop
    kw: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=16, seed=5)
    base = (
        client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
        .choices[0]
        .model_extra["token_ids"]
    )
    at = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    r = client.completions.create(
        **kw, extra_body={"ignore_eos": True, "return_token_ids": True,
                          "stop_token_ids": [base[at]]},
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["token_ids"] == base[: at + 1]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"model": "nope", "prompt": "x"}, "nope"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "x" * 3000}, "context length"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 4000}, "context length"),
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
    ],
)
def test_bad_requests_are_400(stack: Stack, body: dict[str, Any], needle: str) -> None:
    with stack.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_bad_json_is_400(stack: Stack) -> None:
    with stack.client() as c:
        r = c.post("/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


async def _stream(
    aclient: Any, max_tokens: int, seen: list[int], i: int, **extra: Any
) -> dict[str, Any]:
    stream = await aclient.completions.create(
        model="tiny",
        prompt=f"{PROMPT} {i}",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )
    text, toks, finish, last = "", [], None, None
    async for ch in stream:
        c = ch.choices[0]
        text += c.text
        toks += c.model_extra.get("token_ids") or []
        seen[i] = len(toks)
        finish = c.finish_reason or finish
        last = ch
    assert last is not None
    return {
        "text": text,
        "tokens": toks,
        "finish": finish,
        "end": time.monotonic(),
        "extra": last.model_extra,
        "choice": last.choices[0].model_extra,
    }


def test_pause_abort_ends_16_streams_fast(stack: Stack, aclient: Any) -> None:
    async def go() -> tuple[list[dict[str, Any]], float]:
        seen = [0] * 16
        tasks = [asyncio.create_task(_stream(aclient, 1500, seen, i)) for i in range(16)]
        deadline = time.monotonic() + 60
        while min(seen) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert min(seen) >= 2, seen
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as c:
            t0 = time.monotonic()
            r = await c.post("/v1/pause")
            assert r.status_code == 200 and r.json()["result"]["aborted"] == 16
        results = await asyncio.gather(*tasks)
        return results, t0

    results, t0 = asyncio.run(go())
    assert all(r["finish"] == "abort" for r in results)
    assert all(0 < len(r["tokens"]) < 1500 and r["text"] for r in results)
    assert max(r["end"] for r in results) - t0 < 2.0
    assert stack.status()["running"] == 0 and stack.status()["requests"] == 0


def test_requests_wait_while_paused(stack: Stack, client: openai.OpenAI) -> None:
    ctl(stack, "/v1/pause")
    out: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "r", client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
        )
    )
    t.start()
    time.sleep(1.5)
    assert "r" not in out and stack.status()["waiting"] == 1
    ctl(stack, "/v1/resume")
    t.join(30)
    assert out["r"].choices[0].finish_reason in ("length", "stop")


def test_pause_wait_lets_running_finish(stack: Stack, aclient: Any) -> None:
    async def go() -> tuple[dict[str, Any], httpx.Response]:
        seen = [0]
        task = asyncio.create_task(_stream(aclient, 40, seen, 0))
        while seen[0] < 2 and not task.done():
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as c:
            r = await c.post("/v1/pause?mode=wait")
        return await task, r

    res, r = asyncio.run(go())
    assert r.status_code == 200
    assert res["finish"] == "length" and len(res["tokens"]) == 40
    assert stack.status()["state"] == "paused"


def test_keep_across_update_spans_both_versions(stack: Stack, aclient: Any) -> None:
    n = 100

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as c:
            for _ in range(5):
                seen = [0]
                task = asyncio.create_task(_stream(aclient, n, seen, 0))
                while seen[0] < 8 and not task.done():
                    await asyncio.sleep(0.01)
                assert (await c.post("/v1/pause?mode=keep")).status_code == 200
                await asyncio.sleep(0.3)  # chunks of the last step before the pause arrive
                k = seen[0]
                await asyncio.sleep(0.5)
                assert seen[0] == k  # frozen
                if k < n:
                    break
                # it ended before the pause landed (a loaded machine makes hundreds of
                # tokens meanwhile): one version, no ``weight_versions``; once more
                await task
                assert (await c.post("/v1/resume")).status_code == 200
            else:
                pytest.fail(f"every request ended before the pause ({n} tokens)")
            r = await c.post("/v1/update_weights", json={"version": "v1"})
            assert r.status_code == 200, r.text
            assert (await c.post("/v1/resume")).status_code == 200
        res = await task
        res["k"] = k
        return res

    res = asyncio.run(go())
    k, toks = res["k"], res["tokens"]
    assert res["finish"] == "length" and len(toks) == n
    spans = res["extra"]["weight_versions"]
    assert spans == [
        {"version": "v0", "start": 0, "end": k},
        {"version": "v1", "start": k, "end": n},
    ]
    assert res["extra"]["weight_version"] == "v1"
    prompt = prompt_ids(f"{PROMPT} 0")
    assert toks[:k] == greedy(stack.model_dir, prompt, k)
    # after the update the kept request's KV was recomputed with v1
    v1 = stack.model_dir / "versions" / "v1"
    assert toks[k:] == greedy(stack.model_dir, prompt + toks[:k], n - k, weights_dir=v1)


def test_a_coalesced_request_across_an_update_labels_each_token(stack: Stack) -> None:
    """A non-streamed request (its tokens held and sent every 16 steps by the engine) kept
    across pause(keep) + update_weights + resume: every token and logprob once, in
    order; the v0 tokens held at the pause are labelled v0 (not merged into v1's), the
    rest v1, each part equal to its version's greedy tokens."""
    import msgspec
    import nats

    n = 200

    async def go() -> httpx.Response:
        nc = await nats.connect(stack.nats_url)
        items = [0]
        seen = asyncio.Event()

        async def sniff(msg: Any) -> None:  # the API's batches (an unauthenticated server)
            items[0] += len(msgspec.msgpack.decode(msg.data))
            if items[0] >= 2:  # the first token, then 16 more held and sent
                seen.set()

        await nc.subscribe("_INBOX.*.batch", cb=sniff)
        await nc.flush()
        body = {
            "prompt": PROMPT,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 2,
            "return_token_ids": True,
        }
        try:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
                task = asyncio.create_task(c.post("/v1/completions", json=body))
                await asyncio.wait_for(seen.wait(), 60)
                assert (await c.post("/v1/pause?mode=keep")).status_code == 200
                r = await c.post("/v1/update_weights", json={"version": "v1"})
                assert r.status_code == 200, r.text
                assert (await c.post("/v1/resume")).status_code == 200
                return await task
        finally:
            await nc.close()

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    out = r.json()
    (choice,) = out["choices"]
    toks = choice["token_ids"]
    assert len(toks) == n and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == n
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["tokens"]) == n
    spans = choice["weight_versions"]
    k = spans[0]["end"]
    assert 17 <= k < n, spans
    assert spans == [
        {"version": "v0", "start": 0, "end": k},
        {"version": "v1", "start": k, "end": n},
    ]
    assert out["weight_version"] == "v1"
    prompt = prompt_ids(PROMPT)
    assert toks[:k] == greedy(stack.model_dir, prompt, k)
    v1 = stack.model_dir / "versions" / "v1"
    assert toks[k:] == greedy(stack.model_dir, prompt + toks[:k], n - k, weights_dir=v1)


def test_sleep_aborts_running_and_queued_wait_for_wakeup(stack: Stack, aclient: Any) -> None:
    async def go() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        seen = [0, 0]
        tasks = [asyncio.create_task(_stream(aclient, 1500, seen, i)) for i in range(2)]
        while min(seen) < 2 and not any(t.done() for t in tasks):
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as c:
            assert (await c.post("/v1/sleep")).status_code == 200
            aborted = await asyncio.gather(*tasks)
            late = asyncio.create_task(_stream(aclient, 5, [0], 0))
            await asyncio.sleep(1.0)
            assert not late.done()
            assert (await c.post("/v1/wakeup")).status_code == 200
            return aborted, await asyncio.wait_for(late, 30)

    aborted, late = asyncio.run(go())
    assert all(r["finish"] == "abort" and r["tokens"] for r in aborted)
    assert late["finish"] == "length" and len(late["tokens"]) == 5


def test_client_disconnect_frees_the_request(stack: Stack) -> None:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
    }
    left = 'rollbus_generation_errors_total{code="499",route="completions"}'
    before = stack.metric(left)
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leave after the first chunk
    deadline = time.monotonic() + 10
    while stack.status()["requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    st = stack.status()
    assert st["requests"] == 0 and st["running"] == 0
    assert st["free_blocks"] == 512
    assert stack.metric(left) == before + 1  # a client that left is counted, as 499


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(stack: Stack) -> None:
    """Its tokens are coalesced in the engine (not streamed, no stop strings): a client
    that leaves still cancels it there at once, long before its max_tokens."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    left = 'rollbus_generation_errors_total{code="499",route="completions"}'
    before = stack.metric(left)
    steps0 = stack.status()["steps"]
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up: its connection closes
            c.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    deadline = time.monotonic() + 10
    while stack.status()["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    st = stack.status()
    assert st["requests"] == 0 and st["running"] == 0
    assert st["steps"] - steps0 < 2000  # cancelled, not run to its end
    assert st["free_blocks"] == 512
    assert stack.metric(left) == before + 1


def test_kept_request_survives_sleep_and_wakeup(stack: Stack, aclient: Any) -> None:
    """keep, then sleep (KV freed), then wakeup: the request is recomputed and its greedy
    tokens are exactly those of an uninterrupted run."""
    n = 150  # long enough that the stream is still running when the pause lands, even
    # with a fast step loop on a quiet machine

    async def go() -> dict[str, Any]:
        seen = [0] * 4
        task = asyncio.create_task(_stream(aclient, n, seen, 3))
        while seen[3] < 5 and not task.done():
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as c:
            assert (await c.post("/v1/pause?mode=keep")).status_code == 200
            assert (await c.post("/v1/sleep")).status_code == 200
            await asyncio.sleep(0.3)
            assert not task.done()
            assert (await c.post("/v1/wakeup")).status_code == 200
        return await asyncio.wait_for(task, 60)

    res = asyncio.run(go())
    assert res["finish"] == "length"
    assert res["tokens"] == greedy(stack.model_dir, prompt_ids(f"{PROMPT} 3"), n)
    assert "weight_versions" not in res["extra"]


def test_kept_request_survives_a_cancel_while_asleep(stack: Stack, aclient: Any) -> None:
    """keep, sleep, then another client comes and goes while asleep: nothing is sent to
    the sleeping ranks, and the kept request still completes after wakeup."""
    n = 150  # still running when the pause lands (see above)

    async def go() -> dict[str, Any]:
        seen = [0] * 6
        task = asyncio.create_task(_stream(aclient, n, seen, 5))
        while seen[5] < 3 and not task.done():
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as c:
            assert (await c.post("/v1/pause?mode=keep")).status_code == 200
            assert (await c.post("/v1/sleep")).status_code == 200
            body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True}
            try:
                await c.post("/v1/completions", json=body, timeout=1.0)
            except httpx.TimeoutException:
                pass  # it waits while asleep; we leave: the API cancels it
            await asyncio.sleep(0.5)
            assert (await c.post("/v1/wakeup")).status_code == 200
        return await asyncio.wait_for(task, 60)

    res = asyncio.run(go())
    assert res["finish"] == "length" and len(res["tokens"]) == n
    assert res["tokens"] == greedy(stack.model_dir, prompt_ids(f"{PROMPT} 5"), n)
