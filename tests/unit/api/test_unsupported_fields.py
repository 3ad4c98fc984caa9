"""Fields of OpenAI's or vLLM's API that rollbus does not implement are refused (400
naming the field) when they ask for something — never accepted and silently ignored —
and pass when they ask for nothing (the values clients send by default). vLLM's
``include_stop_str_in_output`` is honoured: the text ends with the stop string, and so is
``skip_special_tokens: false``: special tokens are written in the text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.api.body import BadRequest
from services.api.deps import Deps
from services.api.generate import Choice, Delta
from services.api.openai import OpenAIRoutes
from shared import messages as m
from shared.settings import Settings
from shared.tokenizer import IncrementalDecoder

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    from services.tiny_model import create_model_dir

    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    return OpenAIRoutes(Deps(Settings(model=str(model), max_n=8, max_model_len=64)))


BOTH = [
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"json": {}}}, "structured_outputs"),
]
CHAT_ONLY = [
    ({"tools": [TOOL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"documents": [{"text": "d"}]}, "documents"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"echo": True}, "echo"),
    (
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        ]}]},
        "messages[0].content[1].type",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BOTH)
def test_unsupported_fields_are_refused_naming_them(
    routes: OpenAIRoutes, extra: dict[str, Any], param: str
) -> None:
    for body, chat in (({"prompt": "hi", **extra}, False), ({**CHAT, **extra}, True)):
        with pytest.raises(BadRequest) as e:
            routes.parse(body, chat)
        assert e.value.code == 400 and e.value.param == param
        assert "not supported" in e.value.message


@pytest.mark.parametrize(("extra", "param"), CHAT_ONLY)
def test_unsupported_chat_fields_are_refused_naming_them(
    routes: OpenAIRoutes, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as e:
        routes.parse({**CHAT, **extra}, chat=True)
    assert e.value.code == 400 and e.value.param == param


def test_the_values_that_ask_for_nothing_pass(routes: OpenAIRoutes) -> None:
    nothing = {
        "min_p": 0,
        "prompt_logprobs": None,
        "use_beam_search": False,
        "allowed_token_ids": None,
        "bad_words": [],
        "response_format": {"type": "text"},
        "guided_json": None,
        "user": "u",
        "metadata": {"k": "v"},
        "priority": 3,
    }
    routes.parse({"prompt": "hi", **nothing}, chat=False)
    chat = {"tools": [], "tool_choice": "none", "add_generation_prompt": True, "echo": False}
    routes.parse({**CHAT, **nothing, **chat, "tool_choice": "auto"}, chat=True)
    routes.parse({**CHAT, **chat}, chat=True)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    routes.parse({"messages": [{"role": "user", "content": parts}]}, chat=True)


def chunk(ids: list[int], finish: str | None = None) -> m.GenChunk:
    return m.GenChunk("r", 0, ids, [0.0] * len(ids), "v0", finish_reason=finish)


@pytest.mark.parametrize(
    ("keep", "text"), [(False, "say "), (True, "say STOP")]
)  # fmt: skip
def test_include_stop_str_in_output_keeps_the_stop_string(
    routes: OpenAIRoutes, keep: bool, text: str
) -> None:
    tok = routes.tokenizer
    choice = Choice(0, IncrementalDecoder(tok, []), ["STOP", "ST"], keep_stop=keep)
    out = ""
    for piece in ["sa", "y S", "TOP and more"]:
        d = choice.push(chunk(tok.encode(piece, add_special_tokens=False)))
        out += d.text if d else ""
    assert out == text and choice.finish_reason == "stop"


def test_include_stop_str_in_output_is_parsed(routes: OpenAIRoutes) -> None:
    job = routes.parse({"prompt": "hi", "stop": "x", "include_stop_str_in_output": True}, False)
    assert job.keep_stop and not routes.parse({"prompt": "hi"}, False).keep_stop


@pytest.mark.parametrize(("skip", "text"), [(None, "hi"), (True, "hi"), (False, "h<eos>i")])
def test_skip_special_tokens_false_writes_them_in_the_text(
    routes: OpenAIRoutes, skip: bool | None, text: str
) -> None:
    body = {"prompt": "x", **({} if skip is None else {"skip_special_tokens": skip})}
    job = routes.parse(body, chat=False)
    assert job.skip_special is (skip is not False)
    tok = routes.tokenizer  # the byte tokenizer: 257 is <eos>
    decoder = IncrementalDecoder(tok, job.gen.prompt_token_ids, job.skip_special)
    choice = Choice(0, decoder, [])
    # the <eos> that ends the choice is not written (vLLM V1), one inside the text is
    out = "".join(d.text for c in (chunk([104, 257, 105]), chunk([257], "stop"))
                  if (d := choice.push(c)))  # fmt: skip
    assert out == text


@pytest.mark.parametrize(("keep", "text"), [(False, "hi"), (True, "hi!")])
def test_the_stop_token_that_ends_a_choice_is_not_in_its_text(
    routes: OpenAIRoutes, keep: bool, text: str
) -> None:
    """A `stop_token_ids` token (here `!`, an ordinary one) ends the choice and stays in
    its token ids, but its text is cut as a stop string's is (vLLM V1's detokenizer:
    `include_stop_str_in_output` keeps it). It was written in the text."""
    tok = routes.tokenizer
    choice = Choice(0, IncrementalDecoder(tok, []), [], keep_stop=keep)
    out = "".join(d.text for c in (chunk([104]), chunk([105, 33], "stop"))
                  if (d := choice.push(c)))  # fmt: skip
    assert out == text and choice.token_ids == [104, 105, 33]
    assert choice.finish_reason == "stop"
    # a choice that ends on its length writes its last token
    last = Choice(0, IncrementalDecoder(tok, []), [])
    assert last.push(chunk([104, 33], "length")).text == "h!"  # type: ignore[union-attr]


def test_truncate_prompt_tokens_keeps_the_last_ones(routes: OpenAIRoutes) -> None:
    job = routes.parse({"prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2}, chat=False)
    assert job.gen.prompt_token_ids == [4, 5] and job.prompt_tokens == 2
    chat = routes.parse({**CHAT, "truncate_prompt_tokens": 3}, chat=True)
    whole = routes.parse(CHAT, chat=True).gen.prompt_token_ids
    assert chat.gen.prompt_token_ids == whole[-3:]
    many = routes.parse({"prompt": ["abcdef", [7, 8]], "truncate_prompt_tokens": 3}, False)
    assert [g.prompt_token_ids for g in many.gens] == [list(b"def"), [7, 8]]
    with pytest.raises(BadRequest) as e:  # -1: cut to the context (no room left, as vLLM)
        routes.parse({"prompt": [1] * 70, "truncate_prompt_tokens": -1}, chat=False)
    assert "prompt has 64 tokens" in e.value.message
    for bad in (0, -2, 65, True, "3"):
        with pytest.raises(BadRequest) as e:
            routes.parse({"prompt": "hi", "truncate_prompt_tokens": bad}, chat=False)
        assert e.value.param == "truncate_prompt_tokens"


def test_generation_prompt_and_continue_final_message_shape_the_chat_prompt(
    routes: OpenAIRoutes,
) -> None:
    # the tiny model's default chat format: <|role|>\ncontent\n ... then <|assistant|>\n
    def prompt(**extra: Any) -> str:
        job = routes.parse({**CHAT, **extra}, chat=True)
        return routes.tokenizer.decode(job.gen.prompt_token_ids)

    assert prompt().endswith("<|assistant|>\n")
    assert prompt(add_generation_prompt=False) == "<|user|>\nhi\n"
    cont = {"messages": [*CHAT["messages"], {"role": "assistant", "content": "Once upon"}]}
    assert prompt(**cont, continue_final_message=True).endswith("<|assistant|>\nOnce upon")
    with pytest.raises(BadRequest) as e:
        routes.parse({**cont, "continue_final_message": True, "add_generation_prompt": True}, True)
    assert e.value.param == "continue_final_message"


def test_stop_reason_names_the_stop_string_or_token_as_vllm(routes: OpenAIRoutes) -> None:
    """vLLM's `stop_reason`: the stop string that matched (RL code with several stops —
    `</search>`, `</answer>` — and the string cut from the text cannot tell which one
    otherwise), the `stop_token_ids` id that ended the choice, None for the model's eos
    and for `length`."""
    tok = routes.tokenizer  # the byte tokenizer: 257 is <eos>

    def last(stops: list[str], chunks: list[m.GenChunk]) -> Delta:
        choice = Choice(0, IncrementalDecoder(tok, []), stops, eos_ids=frozenset({257}))
        deltas = [d for c in chunks if (d := choice.push(c))]
        assert deltas[-1].stop_reason == choice.stop_reason
        return deltas[-1]

    d = last(["</b>", "</a>"], [chunk(tok.encode("x</a>y", add_special_tokens=False))])
    assert (d.finish_reason, d.stop_reason) == ("stop", "</a>")
    d = last([], [chunk([104]), chunk([33], "stop")])
    assert (d.finish_reason, d.stop_reason) == ("stop", 33)
    assert last([], [chunk([104, 257], "stop")]).stop_reason is None
    assert last([], [chunk([104, 33], "length")]).stop_reason is None


async def test_stop_reason_is_in_the_answer_and_the_last_chunk(routes: OpenAIRoutes) -> None:
    from tests.unit.api.test_stream_shape import Scripted

    deltas = [
        Delta(0, "A", [65], version="v0"),
        Delta(0, "", [33], version="v0", finish_reason="stop", stop_reason=33),
        Delta(1, "B", [66], version="v0", finish_reason="length"),
    ]
    job = routes.parse({"prompt": "hi", "n": 2, "max_tokens": 2}, chat=False)
    body = await routes.complete(job, Scripted(deltas))  # type: ignore[arg-type]
    assert [c["stop_reason"] for c in body["choices"]] == [33, None]
    job = routes.parse({"prompt": "hi", "n": 2, "max_tokens": 2, "stream": True}, chat=False)
    out = [e async for e in routes.sse(job, Scripted(deltas))]  # type: ignore[arg-type]
    chunks = [json.loads(e[6:]) for e in out[:-1]]
    last = {ch["index"]: ch for c in chunks for ch in c["choices"] if ch["finish_reason"]}
    assert last[0]["stop_reason"] == 33 and last[1]["stop_reason"] is None


def test_with_ignore_eos_an_eos_asked_for_in_stop_token_ids_is_the_stop_reason(
    routes: OpenAIRoutes,
) -> None:
    """vLLM V1's ``check_stop``: with ``ignore_eos`` the eos is no eos stop; listed in
    ``stop_token_ids`` it ends the choice as any stop token does, and is its
    ``stop_reason`` (null only for the eos stop ``ignore_eos`` turned off)."""
    from types import SimpleNamespace

    from services.api.generate import GenCall

    tok = routes.tokenizer  # the byte tokenizer: 257 is <eos>
    bus: Any = SimpleNamespace(stream=lambda *a, **k: None)

    def reason(body: dict[str, Any]) -> int | str | None:
        job = routes.parse(body, chat=False)
        call = GenCall(bus, routes.deps.subjects, tok, job.gen, job.stops, eos_ids=job.eos_ids)
        d = call.choices[0].push(chunk([104, 257], "stop"))
        assert d is not None and d.finish_reason == "stop" and d.text == "h"
        return d.stop_reason

    assert reason({"prompt": "hi", "ignore_eos": True, "stop_token_ids": [257]}) == 257
    assert reason({"prompt": "hi", "stop_token_ids": [257]}) is None  # the eos stop
    assert reason({"prompt": "hi"}) is None
