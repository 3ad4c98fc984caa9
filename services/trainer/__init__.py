"""Trainer side: the SDK (``CheckpointPublisher``) and the ``rollbus publish``/``versions`` CLI.

Imported lazily: ``from services.trainer import CheckpointPublisher`` pulls in paddle
(through the model's sharding rules) only when used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointPublisher", "rollout_state_dict"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointPublisher":
        from services.trainer.publisher import CheckpointPublisher

        return CheckpointPublisher
    if name == "rollout_state_dict":
        from services.trainer.rollout import rollout_state_dict

        return rollout_state_dict
    raise AttributeError(name)
