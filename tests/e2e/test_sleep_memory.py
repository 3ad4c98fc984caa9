"""Sleep really frees memory: a few-hundred-MB model, RSS measured on each rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, start_stack
from tests.e2e.test_control import digests, post, rank_call

BIG = {
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}


@pytest.fixture(scope="module")
def big_stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        Path(tmp_path_factory.mktemp("big")),
        nats_url,
        tp=2,
        model_config=BIG,
        model_name="big",
        env={
            "ROLLBUS_SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE": "true",
            "ROLLBUS_CONTROL_TIMEOUT_S": "60",
            "ROLLBUS_KV_CACHE_BLOCKS": "256",
        },
    )
    try:
        yield s
    finally:
        s.stop()


def test_sleep_frees_rss_and_wakeup_is_bit_identical(big_stack: Stack) -> None:
    st = big_stack.status()
    held = {r["rank"]: r["weight_bytes"] + r["kv_bytes"] for r in st["ranks"]}
    assert all(v > 150e6 for v in held.values()), held  # a real model, not a toy
    before_rss = {r["rank"]: r["rss_bytes"] for r in st["ranks"]}
    before = digests(big_stack)
    assert all(
        v["result"]["all_reduce"] == 2.0 for v in rank_call(big_stack, "comm_check").values()
    )

    assert post(big_stack, "/v1/sleep").status_code == 200
    st = big_stack.status()
    for r in st["ranks"]:
        dropped = before_rss[r["rank"]] - r["rss_bytes"]
        assert dropped >= 0.9 * held[r["rank"]], (r["rank"], dropped, held[r["rank"]])
        assert r["comm_group"] is False  # SHUTDOWN_COMM_GROUP_IF_WORKER_IDLE
    assert all(v["error_code"] == 409 for v in rank_call(big_stack, "comm_check").values())

    r = post(big_stack, "/v1/wakeup")
    assert r.status_code == 200, r.text
    st = big_stack.status()
    assert st["state"] == "running"
    assert all(x["comm_group"] and x["weights_loaded"] for x in st["ranks"])
    assert digests(big_stack) == before
    assert all(
        v["result"]["all_reduce"] == 2.0 for v in rank_call(big_stack, "comm_check").values()
    )
