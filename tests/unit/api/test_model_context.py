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


def test_the_default_max_tokens_fits_the_kv_cache(tmp_path: Path) -> None:
    """A context longer than the KV cache holds (a Qwen config's 32768 positions, the
    default 256 x 16-token cache): a chat without ``max_tokens`` gets the rest of what
    the cache holds — not the rest of the context, which the engine refuses ("needs N KV
    blocks") — and a prompt the cache cannot hold is a 400 naming it."""
    d = create_model_dir(tmp_path / "m", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 32768}))
    routes = OpenAIRoutes(Deps(Settings(model=str(d), kv_cache_blocks=4, kv_block_size=16)))
    assert routes.max_model_len == 32768
    chat = routes.parse({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert chat.gen.max_tokens == 64 - len(chat.gen.prompt_token_ids)
    assert routes.parse({"prompt": [1] * 60}, chat=False).gen.max_tokens == 4
    with pytest.raises(BadRequest) as e:
        routes.parse({"prompt": [1] * 64}, chat=False)
    assert e.value.param == "prompt" and "ROLLBUS_KV_CACHE_BLOCKS" in e.value.message
