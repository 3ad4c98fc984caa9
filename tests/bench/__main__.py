"""``just bench`` / ``python -m tests.bench [control|generation|checkpoint|soak|fleet|grpo ...]``
(``publish``: the checkpoint part's publish rows alone, without a stack).

Every benchmark measures its baseline in the same run and prints the ratio. The tables
go to stdout and, machine-readable, to ``bench.json`` (``--json``); the README's
benchmark section is generated from that file by ``python -m tests.bench.report``.
``--quick`` uses small sizes and few calls (to check the method, not for numbers)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from services import natsd
from tests.bench import report
from tests.bench.common import Table, missed


def main() -> None:
    ap = argparse.ArgumentParser(prog="bench")
    ap.add_argument(
        "parts",
        nargs="*",
        default=["control", "generation", "checkpoint", "soak", "fleet", "grpo"],
        help="which benchmarks (default: all); e.g. `python -m tests.bench fleet` runs only that; "
        "`publish`: the checkpoint part's publish rows alone (no stack)",
    )
    ap.add_argument("--calls", type=int, default=0, help="control calls per run and path")
    ap.add_argument("--runs", type=int, default=5, help="runs per cell (>= 5 for the README)")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the method")
    ap.add_argument("--json", type=Path, default=Path("bench.json"), help="results file")
    ap.add_argument("--soak-calls", type=int, default=0, help="soak control calls (10,000)")
    ap.add_argument("--soak-streams", type=int, default=16)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="bench %(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="rollbus-bench-"))
    server = natsd.start(tmp / "nats", port=0)
    t_start = time.time()
    load = [round(x, 2) for x in os.getloadavg()]
    runs, quick = args.runs, args.quick
    tables: list[Table] = []
    out: list[str] = []
    try:
        if "control" in args.parts:
            from tests.bench import control_plane

            calls = args.calls or (50 if quick else 200)
            tables += control_plane.run(tmp, server.url, calls=calls, runs=runs)
        if "generation" in args.parts:
            from tests.bench import generation

            tables += generation.run(tmp, server.url, runs=runs, quick=quick)
        if "checkpoint" in args.parts:
            from tests.bench import checkpoint

            tables += checkpoint.run(tmp, server.url, runs=runs, quick=quick,
                                     nats_pid=server.proc.pid)
        elif "publish" in args.parts:  # the checkpoint part's publish rows alone, no stack
            from tests.bench import checkpoint

            tables += checkpoint.run_publish(tmp, server.url, runs=runs, quick=quick,
                                             nats_pid=server.proc.pid)
        if "fleet" in args.parts:
            from tests.bench import fleet

            tables += fleet.run(tmp, server.url, runs=runs, quick=quick)
        if "grpo" in args.parts:  # starts its own stacks (embedded nats-server each)
            from tests.bench import grpo

            tables += grpo.run(tmp, runs=runs, quick=quick)
        if "soak" in args.parts:
            from tests.bench import soak

            out.append(
                soak.run(
                    tmp,
                    server.url,
                    calls=args.soak_calls or (300 if quick else 10_000),
                    streams=args.soak_streams,
                    nats_pid=server.proc.pid,
                )
            )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "meta": {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
            "command": " ".join(["python -m tests.bench", *sys.argv[1:]]),
            "runs": runs,
            "quick": quick,
            "load_avg": load,
            "cpus": os.cpu_count(),
            "seconds": round(time.time() - t_start, 1),
        },
        "tables": [t.to_json() for t in tables],
    }
    args.json.write_text(json.dumps(doc, indent=1))
    print(report.render(doc))
    print("\n".join(out))
    for line in missed(doc["tables"]):
        print(line)
    print(f"wrote {args.json} ({doc['meta']['seconds']} s); README: "
          f"python -m tests.bench.report {args.json} --readme README.md")


if __name__ == "__main__":
    main()
