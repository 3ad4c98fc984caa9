"""Pick the load strategy (weight source) a rank pulls versions from."""

from __future__ import annotations

from services.worker import model as mdl
from services.worker.weights import LoadedShard, SnapshotSource, Source
from shared.errors import NOT_IMPLEMENTED, ControlError
from shared.settings import Settings


class _NotImplementedSource:
    def __init__(self, name: str, fallback: SnapshotSource) -> None:
        self.name = name
        self.fallback = fallback

    def __call__(self, version: str, verify_checksum: bool) -> LoadedShard:
        # The model dir's own version (version.txt) is always loadable locally; other
        # versions need the strategy itself.
        try:
            return self.fallback(version, verify_checksum)
        except ControlError:
            raise ControlError(
                NOT_IMPLEMENTED, f"load strategy {self.name!r} is not implemented yet"
            ) from None


def make_source(settings: Settings, cfg: mdl.ModelConfig, rank: int) -> Source:
    snap = SnapshotSource(cfg, settings.model_dir, rank, settings.tp)
    if settings.load_strategy == "snapshot":
        return snap
    return _NotImplementedSource(settings.load_strategy, snap)
