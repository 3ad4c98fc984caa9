"""shared.chat_template without transformers (tests/compat checks equality with it):
compiled once, the sandbox's refusals, what the template sees."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from shared import chat_template as ct

USER = [{"role": "user", "content": "hi"}]


def test_compiled_once_per_template_source() -> None:
    src = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ct.compile_template(src) is ct.compile_template(src)
    before = ct.compile_template.cache_info().hits
    ct.render(src, USER)
    ct.render(src, USER)
    assert ct.compile_template.cache_info().hits == before + 2


def test_loopcontrols_generation_tag_and_strftime_now() -> None:
    src = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}|{{ strftime_now('%Y') }}"
    )
    assert ct.render(src, USER * 3) == f"hi|{datetime.now().year}"


def test_tojson_does_not_escape_html_and_takes_options() -> None:
    src = "{{ messages[0] | tojson(sort_keys=true, separators=(',', ':')) }}"
    got = ct.render(src, [{"role": "user", "content": "<b>é</b>"}])
    assert got == '{"content":"<b>é</b>","role":"user"}'


def test_namespace_refuses_underscore_attributes() -> None:
    with pytest.raises(ct.ChatTemplateError, match="underscore"):
        ct.render("{% set ns = namespace(_x=1) %}", USER)


def test_sandbox_refuses_python_internals() -> None:
    with pytest.raises(ct.ChatTemplateError):
        ct.render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", USER)


def test_kwargs_reach_the_template_but_not_reserved_names() -> None:
    src = "{{ enable_thinking }}|{{ bos_token }}|{{ eos_token is defined }}"
    tokens = {"bos_token": "<s>", "eos_token": None}
    got = ct.render(src, USER, True, tokens, {"enable_thinking": 0})
    assert got == "0|<s>|False"  # a missing special token is undefined, as in transformers
    assert ct.render(src, USER, True, {"bos_token": "<s>"}, {"bos_token": "B"}).split("|")[1] == "B"
    with pytest.raises(ct.ChatTemplateError, match="may not set add_generation_prompt"):
        ct.render(src, USER, True, None, {"add_generation_prompt": False})


def test_syntax_error_is_one_chat_template_error() -> None:
    with pytest.raises(ct.ChatTemplateError, match="does not compile"):
        ct.render("{% for %}", USER)


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    import json

    from shared.tokenizer import load_tokenizer
    from tests.fixtures.chat import make_tokenizer_dir

    d = make_tokenizer_dir(tmp_path / "q", "qwen2.5")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "CONFIG"}))
    assert load_tokenizer(d).apply_chat_template(USER).startswith("<|im_start|>system")
    (d / "chat_template.jinja").unlink()  # as transformers: the config's template then
    assert load_tokenizer(d).apply_chat_template(USER) == "CONFIG"
