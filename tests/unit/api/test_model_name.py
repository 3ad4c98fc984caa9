"""The ``model`` of a request: the served id (the model dir's name, or
``ROLLBUS_MODEL_NAME``), or — as vLLM names a model it serves from a path — the
``ROLLBUS_MODEL`` path as given or resolved, unless ``ROLLBUS_MODEL_NAME`` is set.
Anything else is a 400 naming ``model``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.api.body import BadRequest
from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared.settings import Settings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(Path(tmp_path_factory.mktemp("name")) / "policy-7b", seed=0)


def test_the_path_as_given_or_resolved_names_the_model(model_dir: Path) -> None:
    relative = os.path.relpath(model_dir)
    routes = OpenAIRoutes(Deps(Settings(model=relative)))
    for name in ("policy-7b", relative, str(model_dir.resolve()), None):
        body = {"prompt": "hi", **({"model": name} if name else {})}
        assert routes.parse(body, chat=False).gen.prompt_token_ids
    with pytest.raises(BadRequest) as e:
        routes.parse({"prompt": "hi", "model": "policy"}, chat=False)
    assert e.value.param == "model" and "policy-7b" in e.value.message


def test_a_served_name_replaces_the_path(model_dir: Path) -> None:
    routes = OpenAIRoutes(Deps(Settings(model=str(model_dir), model_name="pi")))
    assert routes.parse({"prompt": "hi", "model": "pi"}, chat=False).gen.prompt_token_ids
    for name in ("policy-7b", str(model_dir)):
        with pytest.raises(BadRequest) as e:
            routes.parse({"prompt": "hi", "model": name}, chat=False)
        assert e.value.param == "model"
