"""Chat templates: rollbus renders exactly what transformers' ``apply_chat_template``
renders, on the real-world templates of ``tests/fixtures/chat_templates`` (Llama-3.1,
Llama-3.2 with ``strftime_now``, Qwen2.5, Qwen3 with and without ``enable_thinking``),
with and without the generation prompt, system messages, multi-turn, reasoning history
and tool calls; and ``chat_template_kwargs`` in a request body reach the template (the
prompt ids the API builds equal transformers' tokenized chat)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers as tf
from tokenizers import Tokenizer, processors

from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared.settings import Settings
from shared.tokenizer import load_tokenizer
from tests.fixtures.chat import CHATS, FAMILIES, make_tokenizer_dir

KWARGS: list[dict[str, Any]] = [
    {},
    {"enable_thinking": False},
    {"enable_thinking": True},
    {"date_string": "01 Jan 2025"},
]


BOS = "llama3.1-bos"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for family in FAMILIES:
        d = create_model_dir(root / family, config={"vocab_size": 512})
        out[family] = make_tokenizer_dir(d, family)
    # as Llama-3's own tokenizer.json: its post-processor puts <|begin_of_text|> first,
    # which the template writes itself (transformers tokenizes a chat without specials)
    d = make_tokenizer_dir(create_model_dir(root / BOS, config={"vocab_size": 512}), "llama3.1")
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    bos = "<|begin_of_text|>"
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))]
    )
    raw.save(str(d / "tokenizer.json"))
    out[BOS] = d
    return out


@pytest.fixture(scope="module")
def hf_tokenizers(dirs: dict[str, Path]) -> dict[str, Any]:
    return {f: tf.AutoTokenizer.from_pretrained(str(d)) for f, d in dirs.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_rendered_text_and_ids_equal_transformers(
    dirs: dict[str, Path], hf_tokenizers: dict[str, Any], family: str, chat: str, gen_prompt: bool
) -> None:
    ours, theirs = load_tokenizer(dirs[family]), hf_tokenizers[family]
    for kwargs in KWARGS:
        want = theirs.apply_chat_template(
            CHATS[chat], tokenize=False, add_generation_prompt=gen_prompt, **kwargs
        )
        got = ours.apply_chat_template(CHATS[chat], gen_prompt, chat_template_kwargs=kwargs)
        assert got == want, (family, chat, kwargs)
        ids = theirs.apply_chat_template(
            CHATS[chat], tokenize=True, add_generation_prompt=gen_prompt, **kwargs
        )["input_ids"]
        assert ours.encode(got, add_special_tokens=False) == ids


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("final", ["The capital is", "  Paris, of course.  ", "héllo 🙂\n"])
def test_continue_final_message_equals_transformers(
    dirs: dict[str, Path], hf_tokenizers: dict[str, Any], family: str, final: str
) -> None:
    chat = [*CHATS["system"], {"role": "assistant", "content": final}]
    want = hf_tokenizers[family].apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    got = load_tokenizer(dirs[family]).apply_chat_template(chat, False, continue_final_message=True)
    assert got == want, family
    assert not got.endswith(("<|eot_id|>", "<|im_end|>\n"))


# what the environment offers beyond plain jinja: loopcontrols, {% generation %},
# transformers' tojson options, dict(), namespace(), raise_exception
FEATURES = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}"
    "{% endif %}{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{% generation %}[{{ m.role }}]{{ m.content | trim }}{% endgeneration %}\n{% endfor %}"
    "{{ ns.n }}|{{ messages | tojson }}|{{ messages[-1] | tojson(indent=2, sort_keys=true) }}"
    "|{{ {'b': 1, 'a': 'é<&>'} | tojson(separators=(',', ':'), ensure_ascii=true) }}"
    "|{{ dict(x=1, y=[1, 2]) | tojson }}|{{ dict.fromkeys(['k'], 0) | tojson }}"
    "|{{ bos_token is defined }}{{ eos_token }}{{ pad_token }}|{{ tools }}{{ documents }}"
    "{% if messages | length > 9 %}{{ raise_exception('too long') }}{% endif %}"
)


@pytest.mark.parametrize("chat", list(CHATS))
def test_environment_features_equal_transformers(
    dirs: dict[str, Path], hf_tokenizers: dict[str, Any], chat: str
) -> None:
    from shared import chat_template

    theirs = hf_tokenizers["qwen3"]
    want = theirs.apply_chat_template(CHATS[chat], chat_template=FEATURES, tokenize=False)
    got = chat_template.render(
        FEATURES,
        CHATS[chat],
        False,
        load_tokenizer(dirs["qwen3"]).special_tokens,  # type: ignore[attr-defined]
    )
    assert got == want


def test_raise_exception_refuses_like_transformers(hf_tokenizers: dict[str, Any]) -> None:
    from shared import chat_template

    chat = CHATS["user"] * 10
    with pytest.raises(Exception, match="too long"):
        hf_tokenizers["qwen3"].apply_chat_template(chat, chat_template=FEATURES, tokenize=False)
    with pytest.raises(chat_template.ChatTemplateError, match="too long"):
        chat_template.render(FEATURES, chat)


def test_qwen3_thinking_switch_changes_the_prompt(dirs: dict[str, Path]) -> None:
    tok = load_tokenizer(dirs["qwen3"])
    on = tok.apply_chat_template(CHATS["user"], True, {"enable_thinking": True})
    off = tok.apply_chat_template(CHATS["user"], True, {"enable_thinking": False})
    assert off == on + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", BOS])
@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"date_string": "x"}])
def test_chat_request_prompt_ids_equal_transformers(
    dirs: dict[str, Path], hf_tokenizers: dict[str, Any], family: str, kwargs: Any
) -> None:
    routes = OpenAIRoutes(Deps(Settings(model=str(dirs[family]))))
    body: dict[str, Any] = {"messages": CHATS["multi_turn"], "max_tokens": 1}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    job = routes.parse(body, chat=True)
    want = hf_tokenizers[family].apply_chat_template(
        CHATS["multi_turn"], tokenize=True, add_generation_prompt=True, **(kwargs or {})
    )["input_ids"]
    assert job.gen.prompt_token_ids == want


@pytest.mark.parametrize("family", ["qwen3", BOS])
def test_completion_text_prompt_ids_equal_transformers(
    dirs: dict[str, Path], hf_tokenizers: dict[str, Any], family: str
) -> None:
    """A text prompt of ``/v1/completions`` is encoded as transformers' tokenizer encodes
    it, with the specials its post-processor adds (Llama-3's BOS) — one prompt or a list."""
    routes = OpenAIRoutes(Deps(Settings(model=str(dirs[family]))))
    texts = ["What is the capital of France?", "héllo 🙂 日本語"]
    want = [hf_tokenizers[family](t)["input_ids"] for t in texts]
    job = routes.parse({"prompt": texts[0], "max_tokens": 1}, chat=False)
    assert job.gen.prompt_token_ids == want[0]
    job = routes.parse({"prompt": [texts[1], texts[0]], "max_tokens": 1}, chat=False)
    assert [g.prompt_token_ids for g in job.gens] == want[::-1]
