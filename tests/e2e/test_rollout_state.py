"""Rollout-side state with a real ``paddle.nn`` Llama training model (the example's policy,
``examples/async_grpo/policy.py``) on a real TP=2 stack with its embedded, authenticated
nats-server (the SDK calls run as the trainer role):

- ``rollout_state_dict()`` returns the served weights by inference name, gathered across
  the two ranks, bit-equal to the training model's ``state_dict()`` mapped by
  ``services.trainer.names``, before and after an update;
- publishing the training model's ``state_dict()`` (``CheckpointPublisher``, config asked
  from the instance) and updating makes rollbus generate exactly the training model's
  greedy tokens, with logprobs equal to 1e-4.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import paddle
import pytest

from examples.async_grpo.policy import LlamaForCausalLM, llama_config, write_model_dir
from services.trainer import CheckpointPublisher, names, rollout_state_dict
from shared import creds
from shared.errors import ControlError
from shared.model_config import ModelConfig
from tests.e2e.stack import Stack, free_port, start_stack

HF = llama_config(vocab_size=48, hidden_size=64, layers=2, heads=4, kv_heads=2,
                  intermediate_size=128, max_positions=64, bos=0, eos=1)
CFG = ModelConfig.from_hf(HF)


def policy(seed: int, head_std: float | None = None) -> LlamaForCausalLM:
    paddle.seed(seed)
    m = LlamaForCausalLM(HF)
    m.init_weights(seed, std=0.1, head_std=head_std)
    return m


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    tmp = Path(tmp_path_factory.mktemp("rollout-state"))
    model_dir = write_model_dir(tmp / "models" / "policy", policy(1))
    port = free_port()
    s = start_stack(tmp, None, tp=2, model_dir=model_dir,
                    env={"ROLLBUS_NATS_PORT": str(port)})
    try:
        yield s, creds.role_url(f"nats://127.0.0.1:{port}", "trainer", tmp / "data" / "creds")
    finally:
        s.stop()


def assert_bit_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for n, a in want.items():
        assert got[n].dtype == a.dtype and got[n].shape == a.shape, n
        assert got[n].tobytes() == a.tobytes(), n


def test_names_round_trip_a_paddle_llama_state_dict_bit_exact() -> None:
    m = policy(2)
    sd = m.state_dict()
    to_train = names.get_name_mappings_to_training(CFG)
    assert set(to_train) == set(names.to_inference(sd, CFG))  # every served name
    assert set(to_train.values()) == set(sd)  # onto every training parameter
    assert names.get_name_mappings_to_inference(CFG) == {t: i for i, t in to_train.items()}
    served = names.to_inference(sd, CFG)
    assert served["lm_head.weight"].shape == (48, 64)  # HF [out, in]; paddle keeps [in, out]
    back = names.to_training(served, CFG)
    assert_bit_equal(back, {k: v.numpy() for k, v in sd.items()})


def test_rollout_state_dict_is_the_served_model(served: tuple[Stack, str]) -> None:
    s, url = served
    got = rollout_state_dict(url, s.instance, chunk_bytes=64 * 1024)
    assert got.version == "v0" and got.tp == 2
    assert_bit_equal(got, names.to_inference(policy(1).state_dict(), CFG))


def test_published_training_model_generates_what_it_generates(served: tuple[Stack, str]) -> None:
    s, url = served
    m = policy(5, head_std=1.0)  # a wide lm_head: greedy margins far above fp32 noise
    CheckpointPublisher(url, instance=s.instance).publish("policy", "trained-1",
                                                          m.state_dict(), tp=2)
    with s.client() as c:
        assert c.post("/v1/pause", params={"mode": "keep"}).status_code == 200
        r = c.post("/v1/update_weights", json={"version": "trained-1", "verify_checksum": True})
        assert r.status_code == 200, r.text
        assert c.post("/v1/resume").status_code == 200

    got = rollout_state_dict(url, s.instance)
    assert got.version == "trained-1"
    assert_bit_equal(got, names.to_inference(m.state_dict(), CFG))
    # and back to the training layout: the trainer's own tensors, bit for bit
    assert_bit_equal(names.to_training(got, CFG), {k: v.numpy() for k, v in m.state_dict().items()})

    prompts = [[0, 5, 9, 17], [0, 33], [0, 2, 2, 40, 7, 11], [0, 47, 3]]
    with s.client() as c:
        for p in prompts:
            want, want_lp = m.greedy(p, 10)
            # the reference's margins: top-1 ahead of top-2 by far more than fp32 noise
            with paddle.no_grad():
                logits = m(paddle.to_tensor([p + want[:-1]], dtype="int64"))[0].numpy()
            top2 = np.sort(logits[len(p) - 1 :], axis=-1)[:, -2:]
            assert (top2[:, 1] - top2[:, 0]).min() > 1e-3
            r = c.post("/v1/completions", json={
                "model": "policy", "prompt": p, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
            })
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["weight_version"] == "trained-1"
            ch = body["choices"][0]
            assert ch["token_ids"] == want, p
            assert np.allclose(ch["logprobs"]["token_logprobs"], want_lp, atol=1e-4)


def test_asleep_weights_are_a_clear_409(served: tuple[Stack, str]) -> None:
    s, url = served
    with s.client() as c:
        assert c.post("/v1/sleep", params={"tags": "weight"}).status_code == 200
        try:
            with pytest.raises(ControlError) as e:
                rollout_state_dict(url, s.instance, timeout=10)
            assert e.value.code == 409 and "asleep" in e.value.message
        finally:
            assert c.post("/v1/wakeup").status_code == 200
    assert rollout_state_dict(url, s.instance).version == "trained-1"
