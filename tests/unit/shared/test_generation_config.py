"""generation_config.json's sampling fields as request defaults, read as vLLM reads them
(``ModelConfig.get_diff_sampling_param``): temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (as max_tokens); null = not set; ``do_sample`` is
not read. A field out of range is refused naming it (it would fail every request)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared.model_config import (
    NEUTRAL_SAMPLING,
    ConfigError,
    GenerationDefaults,
    generation_defaults,
)

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}


def write(tmp: Path, cfg: Any) -> Path:
    (tmp / "generation_config.json").write_text(json.dumps(cfg))
    return tmp


def test_the_files_sampling_fields(tmp_path: Path) -> None:
    d = generation_defaults(write(tmp_path, {**QWEN3, "max_new_tokens": 7, "min_p": 0.05}))
    assert d == GenerationDefaults(0.6, 0.95, 20, 0.05, None, 7)
    assert generation_defaults(tmp_path / "nowhere") == GenerationDefaults()


def test_do_sample_false_is_not_read_and_null_is_unset(tmp_path: Path) -> None:
    """vLLM reads neither do_sample (its temperature still applies) nor a null field."""
    d = generation_defaults(
        write(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": None})
    )
    assert d == GenerationDefaults(temperature=0.7)


def test_top_k_minus_one_is_off(tmp_path: Path) -> None:
    assert generation_defaults(write(tmp_path, {"top_k": -1})).top_k == 0


def test_merge_request_then_file_then_neutral() -> None:
    d = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert d.merge({}) == {**NEUTRAL_SAMPLING, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    # a request's value wins, 0 included; None is "not given"
    got = d.merge({"temperature": 0.0, "top_p": None, "top_k": -1, "repetition_penalty": 1.2})
    assert got == {"temperature": 0.0, "top_p": 0.95, "top_k": -1, "min_p": 0.0,
                   "repetition_penalty": 1.2}  # fmt: skip
    assert GenerationDefaults().merge({}) == NEUTRAL_SAMPLING == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 0),
        ("top_p", 1.5),
        ("temperature", -0.1),
        ("temperature", "0.6"),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("max_new_tokens", 0),
        ("temperature", True),
    ],
)
def test_out_of_range_names_the_field(tmp_path: Path, field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as e:
        generation_defaults(write(tmp_path, {**QWEN3, field: value}))
    assert f"{field}={value!r}" in str(e.value) and "ROLLBUS_GENERATION_CONFIG=none" in str(e.value)


def test_not_an_object_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a JSON object"):
        generation_defaults(write(tmp_path, [1]))


def test_the_launcher_refuses_it_in_one_line(tmp_path: Path) -> None:
    """``rollbus serve`` stops before any process starts, one line, exit 2; with
    ROLLBUS_GENERATION_CONFIG=none the file is not read."""
    from services.launcher import LaunchError, check_model
    from services.tiny_model import create_model_dir

    d = create_model_dir(tmp_path / "m", seed=0)
    write(d, {**QWEN3, "top_p": 0})
    with pytest.raises(LaunchError) as e:
        check_model(d, 1, weights=False)
    assert "top_p=0" in str(e.value) and "\n" not in str(e.value)
    check_model(d, 1, weights=False, generation_config=False)


@pytest.mark.parametrize(("value", "code"), [("bogus", 2), ("none", 0), ("auto", 0)])
def test_the_setting(value: str, code: int) -> None:
    """A bad ROLLBUS_GENERATION_CONFIG is the one-line exit-2 refusal of every setting."""
    env = {"ROLLBUS_GENERATION_CONFIG": value, "PATH": "/usr/bin:/bin"}
    code_ = "from shared.settings import settings_or_exit; settings_or_exit('x')"
    r = subprocess.run([sys.executable, "-c", code_], env={**env, "PYTHONPATH": "."},
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == code, r.stderr
    if code:
        assert "ROLLBUS_GENERATION_CONFIG='bogus'" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
