"""Where a worker rank computes (``ROLLBUS_DEVICE``) and what that implies. Pure.

``cpu``: tensors in host memory, collectives over gloo. ``gpu``: rank ``r`` places its
tensors on ``gpu:r`` (one host, one GPU per rank) and the tensor-parallel collectives run
over NCCL; paddle's ``init_parallel_env`` picks the GPU from ``FLAGS_selected_gpus``.
The worker (:mod:`services.worker.comm`) applies this; the check of the paddle build is
:func:`gpu_problem`, given what paddle reports, so it is testable without a GPU.
"""

from __future__ import annotations

from typing import Literal

Device = Literal["cpu", "gpu"]
DEVICES: tuple[Device, ...] = ("cpu", "gpu")
BACKENDS: dict[str, str] = {"cpu": "gloo", "gpu": "nccl"}
GPU_INSTALL = (
    "install paddlepaddle-gpu from PaddlePaddle's wheel index "
    "(README: GPU), or set ROLLBUS_DEVICE=cpu"
)


class DeviceError(ValueError):
    """The device asked for cannot be used here (one line, a start that stops: exit 2)."""


def backend(device: str) -> str:
    """The ``paddle.distributed`` backend of ``device``: gloo on CPU, NCCL on GPU."""
    try:
        return BACKENDS[device]
    except KeyError:
        raise DeviceError(f"ROLLBUS_DEVICE={device!r}: one of {', '.join(DEVICES)}") from None


def paddle_device(device: str, local_rank: int) -> str:
    """The ``paddle.set_device`` argument for a rank: ``cpu`` or ``gpu:<local rank>``."""
    backend(device)  # validates
    return "cpu" if device == "cpu" else f"gpu:{local_rank}"


def comm_env(device: str, local_rank: int) -> dict[str, str]:
    """Environment ``paddle.distributed.init_parallel_env`` reads for this device."""
    env = {"PADDLE_DISTRI_BACKEND": backend(device)}
    if device == "gpu":
        env["FLAGS_selected_gpus"] = str(local_rank)
    return env


def gpu_problem(device: str, tp: int, compiled_with_cuda: bool, gpu_count: int) -> str | None:
    """Why ``device`` cannot serve ``tp`` ranks on this host, or None when it can."""
    backend(device)
    if device != "gpu":
        return None
    if not compiled_with_cuda:
        return f"ROLLBUS_DEVICE=gpu: this paddle build has no CUDA support; {GPU_INSTALL}"
    if gpu_count < tp:
        return (
            f"ROLLBUS_DEVICE=gpu: ROLLBUS_TP={tp} ranks need {tp} GPUs (one each), "
            f"{gpu_count} visible (CUDA_VISIBLE_DEVICES)"
        )
    return None
