"""Response shaping of the OpenAI routes alone (pure functions, no server): logprobs
with their alternatives in OpenAI's two shapes, and a list of prompts parsed into one
engine request each."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.deps import Deps
from services.api.openai import OpenAIRoutes, chat_logprobs, completion_logprobs
from shared import messages as m
from shared.settings import Settings

TEXT = {1: "a", 2: "b", 3: "é", 4: "", 5: ""}  # 4 and 5 decode alike (special tokens)


def label(t: int) -> str:
    return TEXT[t]


def top(ids: list[int], values: list[float]) -> m.TopLogprobs:
    return m.unpack(m.pack(m.TopLogprobs.of(ids, values)), type=m.TopLogprobs)


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    from services.tiny_model import create_model_dir

    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    return OpenAIRoutes(Deps(Settings(model=str(model), max_n=8, max_model_len=64)))


def test_completion_top_logprobs_hold_the_alternatives_and_the_sampled_token() -> None:
    tops = [top([2, 1], [-0.5, -1.0]), top([1, 3], [-0.25, -2.0])]
    out = completion_logprobs([1, 2], [-1.0, -3.0], tops, label)
    assert out["tokens"] == ["a", "b"] and out["token_logprobs"] == [-1.0, -3.0]
    assert out["text_offset"] == [0, 1]
    # position 0: the sampled "a" is among the alternatives; position 1: "b" is added
    assert out["top_logprobs"] == [{"b": -0.5, "a": -1.0}, {"a": -0.25, "é": -2.0, "b": -3.0}]


def test_completion_logprobs_0_or_no_alternatives_give_the_sampled_token_alone() -> None:
    out = completion_logprobs([3, 1], [-0.5, -0.75], None, label)
    assert out["top_logprobs"] == [{"é": -0.5}, {"a": -0.75}]
    assert out["text_offset"] == [0, 1]
    assert completion_logprobs([3, 1], [-0.5, -0.75], None, label, 7)["text_offset"] == [7, 8]


def test_the_sampled_token_keeps_its_own_logprob_in_the_alternatives() -> None:
    """The float32 value of the alternatives never contradicts the reported logprob."""
    lp = -0.123456789012
    out = completion_logprobs([1], [lp], [top([1, 2], [lp, -5.0])], label)
    assert out["top_logprobs"][0]["a"] == lp
    chat = chat_logprobs([1], [lp], [top([1, 2], [lp, -5.0])], label)
    assert chat["content"][0]["top_logprobs"][0]["logprob"] == lp


def test_ids_with_the_same_text_share_one_key_unless_labelled_by_id() -> None:
    tops = [top([4, 5, 1], [-0.125, -0.25, -3.0])]  # exact in float32
    assert completion_logprobs([1], [-3.0], tops, label)["top_logprobs"] == [
        {"": -0.125, "a": -3.0}
    ]
    by_id = completion_logprobs([1], [-3.0], tops, lambda t: f"token_id:{t}")
    assert list(by_id["top_logprobs"][0]) == ["token_id:4", "token_id:5", "token_id:1"]


def test_chat_top_logprobs_are_k_entries_with_bytes_most_likely_first() -> None:
    tops = [top([3, 1, 2], [-0.5, -1.0, -2.0])]
    (entry,) = chat_logprobs([1], [-1.0], tops, label)["content"]
    assert entry["token"] == "a" and entry["logprob"] == -1.0 and entry["bytes"] == [97]
    assert entry["top_logprobs"] == [
        {"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]},
        {"token": "a", "logprob": -1.0, "bytes": [97]},
        {"token": "b", "logprob": -2.0, "bytes": [98]},
    ]
    assert chat_logprobs([1], [-1.0], None, label)["content"][0]["top_logprobs"] == []


def test_packed_logprobs_must_match_the_ids() -> None:
    with pytest.raises(ValueError):
        _ = m.TopLogprobs([1, 2], b"\0\0\0\0").logprobs


def test_a_list_of_prompts_is_one_engine_request_each(routes: OpenAIRoutes) -> None:
    job = routes.parse({"prompt": ["ab", "c"], "n": 2, "logprobs": 3, "max_tokens": 5}, False)
    assert [g.prompt_token_ids for g in job.gens] == [[256, 97, 98], [256, 99]]
    assert len({g.request_id for g in job.gens}) == 2
    assert all(g.n == 2 and g.max_tokens == 5 and g.top_logprobs == 3 for g in job.gens)
    assert job.num_choices == 4 and job.prompt_tokens == 5
    ids = routes.parse({"prompt": [[5, 6], [7]]}, False)
    assert [g.prompt_token_ids for g in ids.gens] == [[5, 6], [7]]
    one = routes.parse({"prompt": [5, 6, 7]}, False)  # token ids: one prompt
    assert [g.prompt_token_ids for g in one.gens] == [[5, 6, 7]]
    assert routes.parse({"prompt": ["x"] * 8}, False).num_choices == 8  # = ROLLBUS_MAX_N


def test_default_max_tokens_is_per_prompt(routes: OpenAIRoutes) -> None:
    """OpenAI's default of 16, within each prompt's own room in the context (64 here)."""
    job = routes.parse({"prompt": [[1] * 10, [1] * 55]}, False)
    assert [g.max_tokens for g in job.gens] == [16, 9]


def test_logprob_options_reach_the_engine_request(routes: OpenAIRoutes) -> None:
    assert routes.parse({"prompt": "x"}, False).gen.logprobs is False
    zero = routes.parse({"prompt": "x", "logprobs": 0}, False).gen
    assert zero.logprobs and zero.top_logprobs == 0
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    g = routes.parse({**chat, "logprobs": True, "top_logprobs": 20}, True).gen
    assert g.logprobs and g.top_logprobs == 20
    g = routes.parse({**chat, "logprobs": False, "top_logprobs": 0}, True).gen
    assert not g.logprobs and g.top_logprobs == 0
    job = routes.parse({"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True}, False)
    assert job.as_token_ids
