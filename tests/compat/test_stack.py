"""transformers checkpoints served by a real rollbus stack (``rollbus serve`` with
``ROLLBUS_MODEL`` = the HF dir: launcher, engine, gloo ranks, API) answer
``/v1/completions`` (prompt as token ids, temperature 0, logprobs, return_token_ids)
with transformers' greedy tokens and logprobs, and with the ``top_logprobs`` of torch's
``log_softmax`` of transformers' logits. One stack per family, shared by the module's
tests.

The llama model's ``generation_config.json`` lists a second eos id — a token its greedy
continuation emits mid-way, as Llama-3 instruct ends turns on ``<|eot_id|>``: transformers
stops there, and so must rollbus."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hf
import httpx
import numpy as np
import pytest
from cases import BY_NAME, NEW_TOKENS, PROMPTS

from shared.messages import MAX_TOP_LOGPROBS
from tests.e2e.stack import Stack, start_stack

FIRST_EOS_STEP = 3  # the llama stack's extra eos id: the first new token from this step on
STACKS = {  # case -> tp of its stack
    "llama3": 2,
    "qwen3": 2,
    "qwen2-bf16": 1,
}


def complete(stack: Stack, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
        **extra,
    }
    r = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {
        "tokens": choice["token_ids"],
        "logprobs": np.array(choice["logprobs"]["token_logprobs"]),
        "finish_reason": choice["finish_reason"],
        "top": choice["logprobs"]["top_logprobs"],
    }


class Served:
    def __init__(self, name: str, stack: Stack, refs: list[dict[str, Any]]) -> None:
        self.name, self.stack, self.refs = name, stack, refs


@pytest.fixture(scope="module", params=list(STACKS))
def served(
    request: pytest.FixtureRequest,
    model_dirs: dict[str, Path],
    nats_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    name = request.param
    tmp = tmp_path_factory.mktemp(f"stack-{name}")
    model_dir = tmp / name
    shutil.copytree(model_dirs[name], model_dir)
    if name == "llama3":
        first = hf.reference(model_dir, PROMPTS[0], NEW_TOKENS)["tokens"]
        step = next(i for i in range(FIRST_EOS_STEP, NEW_TOKENS) if first[i] not in first[:i])
        eot = first[step]
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text())
        gen["eos_token_id"] = [gen["eos_token_id"], eot]
        gen_path.write_text(json.dumps(gen))
    refs = [hf.reference(model_dir, p, NEW_TOKENS) for p in PROMPTS]
    stack = start_stack(
        tmp, nats_url, tp=STACKS[name], model_dir=model_dir, env={"ROLLBUS_MAX_MODEL_LEN": "64"}
    )
    try:
        yield Served(name, stack, refs)
    finally:
        stack.stop()


def test_completions_equal_transformers(served: Served) -> None:
    tol = BY_NAME[served.name].tolerance
    for prompt, ref in zip(PROMPTS, served.refs, strict=True):
        got = complete(served.stack, prompt)
        assert got["tokens"] == ref["tokens"], f"{served.name}: greedy tokens differ"
        diff = np.abs(got["logprobs"] - ref["logprobs"]).max()
        assert diff < tol, f"{served.name}: chosen-token logprobs differ by {diff:.2e}"


def test_concurrent_requests_equal_transformers(served: Served) -> None:
    """Requests of different lengths batched together by the engine (shared decode
    steps, a prefill beside decodes) still give transformers' tokens."""
    jobs = [(p, r) for p, r in zip(PROMPTS, served.refs, strict=True)] * 3
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(served.stack, job[0]), jobs))
    tol = BY_NAME[served.name].tolerance
    for (_, ref), got in zip(jobs, answers, strict=True):
        assert got["tokens"] == ref["tokens"], f"{served.name}: greedy tokens differ"
        assert np.abs(got["logprobs"] - ref["logprobs"]).max() < tol


@pytest.mark.parametrize("served", ["llama3"], indirect=True)
def test_every_eos_id_stops(served: Served) -> None:
    ref = served.refs[0]
    assert FIRST_EOS_STEP < len(ref["tokens"]) < NEW_TOKENS  # stopped on the second eos id
    got = complete(served.stack, PROMPTS[0])
    assert got["tokens"] == ref["tokens"] and got["finish_reason"] == "stop"
    # ignore_eos runs on to max_tokens, through the eos id
    free = complete(served.stack, PROMPTS[0], ignore_eos=True)
    assert len(free["tokens"]) == NEW_TOKENS and free["finish_reason"] == "length"
    assert free["tokens"][: len(ref["tokens"])] == ref["tokens"]


def test_top_logprobs_equal_torch_log_softmax(served: Served) -> None:
    """The k alternatives per position (ids by ``return_tokens_as_token_ids``) are the k
    largest entries of torch's ``log_softmax`` over transformers' logits at that step,
    their values within the case's tolerance; ids must match exactly wherever the k-th
    and the next value are further apart than the tolerance."""
    k = MAX_TOP_LOGPROBS
    tol = BY_NAME[served.name].tolerance
    for prompt, ref in zip(PROMPTS, served.refs, strict=True):
        got = complete(served.stack, prompt, logprobs=k, return_tokens_as_token_ids=True)
        assert got["tokens"] == ref["tokens"]
        assert len(got["top"]) == len(ref["tokens"])
        for step, alts in enumerate(got["top"]):
            row = ref["log_softmax"][step]
            ids = [int(t.removeprefix("token_id:")) for t in alts]
            values = np.array(list(alts.values()))
            assert len(set(ids)) == k == len(ids)  # greedy: the sampled token is among them
            diff = np.abs(values - row[ids]).max()
            assert diff < tol, f"{served.name} step {step}: top logprobs differ by {diff:.2e}"
            ranked = np.sort(row)[::-1]
            assert row[ids].min() >= ranked[k - 1] - tol, f"step {step}: not the top {k}"
            if ranked[k - 1] - ranked[k] > 2 * tol:
                assert set(ids) == set(np.argsort(-row)[:k].tolist())
