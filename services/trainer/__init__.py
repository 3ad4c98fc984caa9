"""Trainer side: the SDK (``CheckpointPublisher``) and the ``rollbus publish``/``versions`` CLI.

Imported lazily, so ``services.cli`` stays light. Nothing here imports paddle or the
worker: the sharding rules and the model config come from ``shared`` (import-linter keeps
it so), and a paddle state dict is read through ``numpy()``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointPublisher", "publish", "rollout_state_dict"]


def publish(
    model: str,
    version: str,
    source: Any,
    *,
    tp: int,
    nats_url: str = "nats://127.0.0.1:4222",
    config: Any = None,
    instance: str = "default",
    ipc: bool = False,
    allow_nonfinite: bool = False,
) -> Any:
    """``publish(model, version, state_dict | dir, tp=...)``: one call, as in the design.

    A state dict without ``config`` is sharded by the config the rollout instance serves.
    A NaN/Inf weight is refused (``NonFiniteWeight``) unless ``allow_nonfinite``.
    Returns the :class:`~services.trainer.publisher.PublishResult`."""
    from services.trainer.publisher import CheckpointPublisher

    pub = CheckpointPublisher(nats_url, instance=instance)
    return pub.publish(
        model, version, source, tp=tp, config=config, ipc=ipc, allow_nonfinite=allow_nonfinite
    )


def __getattr__(name: str) -> Any:
    if name == "CheckpointPublisher":
        from services.trainer.publisher import CheckpointPublisher

        return CheckpointPublisher
    if name == "rollout_state_dict":
        from services.trainer.rollout import rollout_state_dict

        return rollout_state_dict
    raise AttributeError(name)
