"""``stop_reason`` for a choice that ends on one of the model's *other* eos ids (a
``generation_config.json`` with several, as Llama-3's ``[128001, 128008, 128009]``): that
id, as vLLM names it (the extra ids are stop tokens there); null only for the
tokenizer's own eos."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.api.deps import Deps
from services.api.generate import GenCall, eos_ids_of
from services.api.openai import OpenAIRoutes
from shared import messages as m
from shared.settings import Settings
from shared.tokenizer import load_tokenizer
from tests.unit.shared.test_tokenizer import make_hf_dir

EXTRA = 299  # an eos id of generation_config.json besides the tokenizer's <eos> (257)


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    from services.tiny_model import create_model_dir

    model = create_model_dir(Path(tmp_path_factory.mktemp("m")) / "tiny", seed=0)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, EXTRA]}))
    return OpenAIRoutes(Deps(Settings(model=str(model), max_model_len=64)))


def _reason(routes: OpenAIRoutes, body: dict[str, Any], last: int) -> int | str | None:
    job = routes.parse(body, chat=False)
    bus: Any = SimpleNamespace(stream=lambda *a, **k: None)
    call = GenCall(
        bus, routes.deps.subjects, routes.tokenizer, job.gen, job.stops, eos_ids=job.eos_ids
    )
    d = call.choices[0].push(m.GenChunk("r", token_ids=[104, last], finish_reason="stop"))
    assert d is not None and d.finish_reason == "stop" and d.text == "h"
    return d.stop_reason


def test_a_generation_config_eos_id_is_named(routes: OpenAIRoutes) -> None:
    assert EXTRA in routes.tokenizer.stop_token_ids  # it does stop generation
    assert _reason(routes, {"prompt": "hi"}, EXTRA) == EXTRA
    assert _reason(routes, {"prompt": "hi"}, 257) is None  # the tokenizer's eos
    # ignore_eos: no eos stop at all; one asked for in stop_token_ids is named
    assert (
        _reason(routes, {"prompt": "hi", "ignore_eos": True, "stop_token_ids": [257]}, 257) == 257
    )


def test_gencall_default_names_the_extra_eos_too(routes: OpenAIRoutes) -> None:
    job = routes.parse({"prompt": "hi"}, chat=False)
    bus: Any = SimpleNamespace(stream=lambda *a, **k: None)
    call = GenCall(bus, routes.deps.subjects, routes.tokenizer, job.gen, job.stops)
    d = call.choices[0].push(m.GenChunk("r", token_ids=[EXTRA], finish_reason="stop"))
    assert d is not None and d.stop_reason == EXTRA


def test_hf_tokenizer_eos_is_the_only_unnamed_stop(tmp_path: Path) -> None:
    d = make_hf_dir(tmp_path, None)  # tokenizer_config eos "</s>" (id 1); config.json [1, 5]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 1, 7]}))
    tok = load_tokenizer(d)
    assert tok.eos_token_id == 1 and set(tok.stop_token_ids) == {1, 5, 7}
    assert eos_ids_of(tok) == frozenset({1})


@pytest.mark.parametrize(
    "tcfg_eos,smap_eos,eos",
    [
        (None, "</s>", 1),  # an older repo: the eos named in special_tokens_map.json only
        ("</s>", "<s>", 0),  # both: special_tokens_map.json's wins, as in transformers
    ],
)
def test_the_tokenizer_eos_is_transformers_one(
    tmp_path: Path, tcfg_eos: str | None, smap_eos: str, eos: int
) -> None:
    """The unnamed eos is the one transformers' tokenizer has (vLLM's ``eos_token_id``),
    not generation_config.json's first id: checked against transformers 5.x by hand."""
    d = make_hf_dir(tmp_path, None)  # "<s>" is id 0, "</s>" id 1
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg.pop("eos_token")
    if tcfg_eos is not None:
        tcfg["eos_token"] = tcfg_eos
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": smap_eos}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 1]}))
    tok = load_tokenizer(d)
    assert eos_ids_of(tok) == frozenset({eos})
    assert {1, 5} <= set(tok.stop_token_ids)  # every eos id still stops generation
