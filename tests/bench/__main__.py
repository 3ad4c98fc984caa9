"""``just bench`` / ``python -m tests.bench [control|generation|checkpoint ...]``.

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
    ap.add_argument("parts", nargs="*", default=["control", "generation", "checkpoint"])
    ap.add_argument("--calls", type=int, default=500)
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
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(out))


if __name__ == "__main__":
    main()
