"""shared.device: ROLLBUS_DEVICE -> backend, paddle device, init_parallel_env's
environment, and the GPU check from what paddle reports (no GPU needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.device import DeviceError, backend, comm_env, gpu_problem, paddle_device
from shared.settings import Settings


def test_cpu_is_gloo_gpu_is_nccl() -> None:
    assert backend("cpu") == "gloo" and backend("gpu") == "nccl"
    with pytest.raises(DeviceError, match="one of cpu, gpu"):
        backend("tpu")


def test_rank_r_computes_on_gpu_r() -> None:
    assert [paddle_device("gpu", r) for r in range(3)] == ["gpu:0", "gpu:1", "gpu:2"]
    assert paddle_device("cpu", 3) == "cpu"


def test_parallel_env_selects_the_ranks_gpu() -> None:
    assert comm_env("cpu", 1) == {"PADDLE_DISTRI_BACKEND": "gloo"}
    assert comm_env("gpu", 1) == {"PADDLE_DISTRI_BACKEND": "nccl", "FLAGS_selected_gpus": "1"}


@pytest.mark.parametrize(
    ("device", "tp", "cuda", "gpus", "problem"),
    [
        ("cpu", 2, False, 0, None),
        ("gpu", 2, True, 2, None),
        ("gpu", 1, False, 0, "no CUDA support"),
        ("gpu", 4, True, 2, "ROLLBUS_TP=4 ranks need 4 GPUs (one each), 2 visible"),
    ],
)
def test_gpu_problem(device: str, tp: int, cuda: bool, gpus: int, problem: str | None) -> None:
    got = gpu_problem(device, tp, cuda, gpus)
    assert got == problem if problem is None else (got is not None and problem in got)
    assert got is None or "\n" not in got


def test_device_setting() -> None:
    assert Settings().device == "cpu"
    assert Settings(device="gpu").device == "gpu"
    with pytest.raises(ValidationError):
        Settings(device="cuda")
