"""The API's uvicorn picks uvloop and httptools (runtime dependencies), h11 and asyncio
when they cannot be imported."""

from __future__ import annotations

import sys

import pytest
from starlette.applications import Starlette

from services.api.main import server_choice, uvicorn_config


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_the_api_serves_with_uvloop_and_httptools() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = uvicorn_config(Starlette(), "127.0.0.1", 0)
    assert (config.loop, config.http) == ("uvloop", "httptools")
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
    assert config.get_loop_factory().__module__.startswith("uvloop")


def test_without_them_it_falls_back_to_asyncio_and_h11(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert server_choice() == ("asyncio", "h11")
    config = uvicorn_config(Starlette(), "127.0.0.1", 0)
    config.load()
    assert config.http_protocol_class.__name__ == "H11Protocol"
