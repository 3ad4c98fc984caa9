"""``just bench`` / ``python -m tests.bench [control|generation|checkpoint|soak ...]``.

Every benchmark measures its baseline in the same run and prints the ratio."""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

from services import natsd


def main() -> None:
    ap = argparse.ArgumentParser(prog="bench")
    ap.add_argument(
        "parts", nargs="*", default=["control", "generation", "checkpoint", "soak"]
    )
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--soak-calls", type=int, default=10_000)
    ap.add_argument("--soak-streams", type=int, default=16)
    args = ap.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="rollbus-bench-"))
    server = natsd.start(tmp / "nats", port=0)
    out = []
    try:
        if "control" in args.parts:
            from tests.bench import control_plane

            out.append(control_plane.run(tmp, server.url, calls=args.calls))
        if "generation" in args.parts:
            from tests.bench import generation

            out.append(generation.run(tmp, server.url))
        if "checkpoint" in args.parts:
            from tests.bench import checkpoint

            out.append(checkpoint.run(tmp, server.url))
        if "soak" in args.parts:
            from tests.bench import soak

            out.append(
                soak.run(
                    tmp,
                    server.url,
                    calls=args.soak_calls,
                    streams=args.soak_streams,
                    nats_pid=server.proc.pid,
                )
            )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(out))


if __name__ == "__main__":
    main()
