"""Token ids in a request are checked against the model's vocabulary (config.json's
``vocab_size``, the embedding rows), not the tokenizer's: a checkpoint whose embedding
is padded past its tokenizer (as Qwen's are) takes every id it has, as transformers
does; an id past the embedding is a 400 whatever the tokenizer holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.body import BadRequest
from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared.settings import Settings
from tests.fixtures.chat import make_tokenizer_dir

MODEL_VOCAB = 512


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> OpenAIRoutes:
    d = create_model_dir(
        Path(tmp_path_factory.mktemp("pad")) / "qwen3", config={"vocab_size": MODEL_VOCAB}
    )
    make_tokenizer_dir(d, "qwen3")
    return OpenAIRoutes(Deps(Settings(model=str(d))))


def test_ids_past_the_tokenizer_within_the_model_are_accepted(routes: OpenAIRoutes) -> None:
    top = MODEL_VOCAB - 1
    assert routes.tokenizer.vocab_size < top  # the embedding is padded past the tokenizer
    job = routes.parse(
        {"prompt": [[3, top], [top]], "stop_token_ids": [top], "logit_bias": {str(top): 1}},
        chat=False,
    )
    assert [g.prompt_token_ids for g in job.gens] == [[3, top], [top]]
    assert top in job.gen.stop_token_ids


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [3, MODEL_VOCAB]}, "prompt"),
        ({"prompt": "hi", "stop_token_ids": [MODEL_VOCAB]}, "stop_token_ids"),
        ({"prompt": "hi", "logit_bias": {str(MODEL_VOCAB): 1}}, "logit_bias"),
    ],
)
def test_ids_past_the_model_are_400(routes: OpenAIRoutes, body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as e:
        routes.parse(body, chat=False)
    assert e.value.code == 400 and e.value.param == param
