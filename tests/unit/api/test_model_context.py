"""Without ``ROLLBUS_MAX_MODEL_LEN`` the context length is the model's own (config.json's
``max_position_embeddings``, times the factor of linear / dynamic RoPE, as vLLM derives
it): a prompt or prompt + ``max_tokens`` past it is a clear 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.api.body import BadRequest
from services.api.deps import Deps
from services.api.openai import OpenAIRoutes
from services.tiny_model import create_model_dir
from shared.settings import Settings


def routes_for(tmp: Path, **config: object) -> OpenAIRoutes:
    d = create_model_dir(tmp / "m", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **config}))
    return OpenAIRoutes(Deps(Settings(model=str(d))))


@pytest.mark.parametrize(
    ("config", "limit"),
    [
        ({"max_position_embeddings": 40}, 40),
        ({"max_position_embeddings": 20, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, 40),
    ],
)
def test_context_length_from_config_json(tmp_path: Path, config: dict, limit: int) -> None:
    routes = routes_for(tmp_path, **config)
    assert routes.max_model_len == limit
    ok = routes.parse({"prompt": [1] * 30, "max_tokens": limit - 30}, chat=False)
    assert ok.gen.max_tokens == limit - 30
    with pytest.raises(BadRequest) as e:
        routes.parse({"prompt": [1] * 30, "max_tokens": limit - 29}, chat=False)
    assert e.value.param == "max_tokens" and f"maximum context length {limit}" in e.value.message
    with pytest.raises(BadRequest) as e:
        routes.parse({"prompt": [1] * limit}, chat=False)
    assert e.value.param == "prompt" and f"the maximum context length is {limit}" in e.value.message
