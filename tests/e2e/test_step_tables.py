"""Step messages carry every row's KV block table. A long context in small blocks and many
choices make them large: past the NATS server's ``max_payload`` the step's publish failed,
and every live request with it (503). Checked on a server whose max_payload is 32 KiB."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.e2e.stack import Stack, small_payload_stack

MAX_PAYLOAD = 32 * 1024
# a block per token: a row's block table is a block id (up to 3 msgpack bytes) per token
ENV = {
    "ROLLBUS_KV_BLOCK_SIZE": "1",
    "ROLLBUS_KV_CACHE_BLOCKS": "16384",
    "ROLLBUS_MAX_MODEL_LEN": "16384",
}


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with small_payload_stack(tmp_path_factory, "tables", MAX_PAYLOAD, tp=1, env=ENV) as s:
        yield s


def post(stack: Stack, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with stack.client(timeout=120) as c:
        r = c.post("/v1/completions", json={"model": stack.model_dir.name} | body)
    return r.status_code, r.json()


NORMAL = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_block_tables_past_max_payload_share_steps(small_stack: Stack) -> None:
    """n=16 choices of a 1000-token prompt: 16 rows of ~1000 block ids, ~43 KB in one step.
    They now go in several steps: every request completes, none gets a 503."""
    long = {"prompt": [i % 100 for i in range(1000)], "max_tokens": 4, "n": 16,
            "ignore_eos": True}  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        normal = pool.submit(post, small_stack, NORMAL)
        wide = [pool.submit(post, small_stack, long) for _ in range(2)]
        results = [f.result() for f in [normal, *wide]]
    assert [code for code, _ in results] == [200] * 3, [
        (code, body.get("error")) for code, body in results
    ]
    for _, body in results[1:]:
        assert len(body["choices"]) == 16
        assert all(c["finish_reason"] == "length" for c in body["choices"]), body["choices"]
    with small_stack.client() as c:
        assert c.get("/health").status_code == 200


def test_a_request_whose_block_table_can_never_fit_is_400_naming_the_cause(
    small_stack: Stack,
) -> None:
    """A row of it alone would pass the message: refused at admission, naming the field
    whose length makes its block table, while a request beside it is served."""
    with ThreadPoolExecutor(3) as pool:
        normal = pool.submit(post, small_stack, NORMAL)
        by_prompt = pool.submit(post, small_stack, {"prompt": [7] * 12000, "max_tokens": 4})
        by_output = pool.submit(post, small_stack, {"prompt": [7] * 1000, "max_tokens": 11000})
        for refused, param in ((by_prompt, "prompt"), (by_output, "max_tokens")):
            code, body = refused.result()
            assert code == 400, body
            assert body["error"]["param"] == param, body
            assert "block table" in body["error"]["message"], body
        code, body = normal.result()
    assert code == 200, body
