"""services.worker.comm.place on this (CPU) paddle build: cpu is placed, gpu is refused
with one line; configure_env hands init_parallel_env the device's backend."""

from __future__ import annotations

import os

import paddle
import pytest

from services.worker.comm import configure_env, place
from shared.device import DeviceError


def test_cpu_is_placed() -> None:
    assert place("cpu", 1, 2) == "cpu"
    assert paddle.device.get_device() == "cpu"
    assert paddle.zeros([2]).place.is_cpu_place()


@pytest.mark.skipif(paddle.device.is_compiled_with_cuda(), reason="a CUDA build is here")
def test_gpu_without_cuda_build_is_one_clear_line() -> None:
    with pytest.raises(DeviceError) as e:
        place("gpu", 0, 1)
    assert "no CUDA support" in str(e.value) and "\n" not in str(e.value)
    assert paddle.device.get_device() == "cpu"  # nothing changed


def test_configure_env_sets_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("PADDLE_DISTRI_BACKEND", "FLAGS_selected_gpus", "PADDLE_TRAINER_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    configure_env(1, 2, ["127.0.0.1:1", "127.0.0.1:2"], "gpu")
    assert os.environ["PADDLE_DISTRI_BACKEND"] == "nccl"
    assert os.environ["FLAGS_selected_gpus"] == "1"
    assert os.environ["PADDLE_CURRENT_ENDPOINT"] == "127.0.0.1:2"
    configure_env(0, 2, ["127.0.0.1:1", "127.0.0.1:2"])
    assert os.environ["PADDLE_DISTRI_BACKEND"] == "gloo"
