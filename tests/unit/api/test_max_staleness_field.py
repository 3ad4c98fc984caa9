"""``max_staleness`` on the OpenAI routes: an integer >= 0, else 400 naming it; passed
to the engine in the gen message."""

from __future__ import annotations

from typing import Any

import pytest

from services.api.body import BadRequest
from services.api.openai import OpenAIRoutes
from tests.unit.api.test_validation import routes  # noqa: F401 - the module fixture


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("value", [-1, 1.5, "2", True, [1], 2**63])
def test_bad_max_staleness_is_400_naming_it(
    routes: OpenAIRoutes,  # noqa: F811
    chat: bool,
    value: Any,
) -> None:
    body: dict[str, Any] = {"max_staleness": value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    with pytest.raises(BadRequest) as e:
        routes.parse(body, chat)
    assert e.value.code == 400 and e.value.param == "max_staleness"


@pytest.mark.parametrize("chat", [False, True])
def test_max_staleness_reaches_the_gen_message(
    routes: OpenAIRoutes,  # noqa: F811
    chat: bool,
) -> None:
    base: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    )
    assert routes.parse({**base, "max_staleness": 0}, chat).gen.max_staleness == 0
    assert routes.parse({**base, "max_staleness": 3}, chat).gen.max_staleness == 3
    assert routes.parse({**base, "max_staleness": None}, chat).gen.max_staleness is None
    assert routes.parse(base, chat).gen.max_staleness is None
