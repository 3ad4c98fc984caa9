"""Split a full HF-named state dict into per-rank safetensors shards plus a manifest.

Used by the publisher (object store) and to write pre-sharded snapshot versions
(``<model>/versions/<V>/rank<r>-of-<tp>.safetensors`` + ``manifest.json``).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from services.worker import model as mdl
from shared import manifest as mf
from shared.subjects import rank_shard_file


def shard_state(
    cfg: mdl.ModelConfig, state: dict[str, np.ndarray], tp: int
) -> list[dict[str, np.ndarray]]:
    """One dict per rank; raises ``ValueError`` naming a missing or mis-shaped tensor."""
    cfg.validate_tp(tp)
    shapes = mdl.full_shapes(cfg)
    missing = [n for n in shapes if n not in state]
    if missing:
        raise ValueError(f"state dict lacks {missing[:5]}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(state[name].shape)}, config says {shape}")
    return [
        {n: mdl.shard_tensor(cfg, n, np.asarray(state[n]), r, tp) for n in shapes}
        for r in range(tp)
    ]


def serialize(
    cfg: mdl.ModelConfig, state: dict[str, np.ndarray], tp: int, model: str, version: str
) -> tuple[list[bytes], mf.Manifest]:
    """Safetensors bytes per rank and the manifest describing them."""
    blobs: list[bytes] = []
    specs: list[mf.ShardSpec] = []
    for r, shard in enumerate(shard_state(cfg, state, tp)):
        blob = save(shard)
        blobs.append(blob)
        specs.append(
            mf.ShardSpec(
                rank=r,
                file=rank_shard_file(r, tp),
                size=len(blob),
                sha256=hashlib.sha256(blob).hexdigest(),
                tensors={
                    n: mf.TensorSpec(shape=list(a.shape), dtype=str(a.dtype))
                    for n, a in shard.items()
                },
            )
        )
    return blobs, mf.Manifest(
        model=model, version=version, tp=tp, shards=specs, created=time.time()
    )


def write_sharded_dir(
    out_dir: Path,
    cfg: mdl.ModelConfig,
    state: dict[str, np.ndarray],
    tp: int,
    model: str,
    version: str,
) -> mf.Manifest:
    out_dir.mkdir(parents=True, exist_ok=True)
    blobs, man = serialize(cfg, state, tp, model, version)
    for spec, blob in zip(man.shards, blobs, strict=True):
        (out_dir / spec.file).write_bytes(blob)
    (out_dir / "manifest.json").write_bytes(mf.encode(man))
    return man
