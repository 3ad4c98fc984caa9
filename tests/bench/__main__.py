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
from typing import Any

from services import natsd
from tests.bench import report
from tests.bench.common import Table, missed

PARTS = ["control", "generation", "checkpoint", "soak", "fleet", "grpo"]


def run_part(part: str, ctx: dict[str, Any]) -> list[Table] | str:
    """One part's tables (the soak part: its text)."""
    tmp, url, runs, quick = ctx["tmp"], ctx["url"], ctx["runs"], ctx["quick"]
    args = ctx["args"]
    if part == "control":
        from tests.bench import control_plane

        return control_plane.run(tmp, url, calls=args.calls or (50 if quick else 200),
                                 runs=runs)
    if part == "generation":
        from tests.bench import generation

        return generation.run(tmp, url, runs=runs, quick=quick)
    if part == "checkpoint":
        from tests.bench import checkpoint

        return checkpoint.run(tmp, url, runs=runs, quick=quick, nats_pid=ctx["nats_pid"])
    if part == "publish":  # the checkpoint part's publish rows alone, no stack
        from tests.bench import checkpoint

        return checkpoint.run_publish(tmp, url, runs=runs, quick=quick,
                                      nats_pid=ctx["nats_pid"])
    if part == "fleet":
        from tests.bench import fleet

        return fleet.run(tmp, url, runs=runs, quick=quick)
    if part == "grpo":  # starts its own stacks (embedded nats-server each)
        from tests.bench import grpo

        return grpo.run(tmp, runs=runs, quick=quick)
    if part == "soak":
        from tests.bench import soak

        return soak.run(tmp, url, calls=args.soak_calls or (300 if quick else 10_000),
                        streams=args.soak_streams, nats_pid=ctx["nats_pid"])
    raise ValueError(part)


def order(parts: list[str]) -> list[str]:
    """The parts to run, in the bench's order (``publish`` only without ``checkpoint``)."""
    known = ["control", "generation", "checkpoint", "publish", "fleet", "grpo", "soak"]
    bad = [p for p in parts if p not in known]
    if bad:
        raise SystemExit(f"bench: unknown part(s) {', '.join(bad)} (known: {', '.join(known)})")
    out = [p for p in known if p in parts]
    if "checkpoint" in out and "publish" in out:
        out.remove("publish")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench")
    ap.add_argument(
        "parts",
        nargs="*",
        default=PARTS,
        help="which benchmarks (default: all); e.g. `python -m tests.bench fleet` runs only that; "
        "`publish`: the checkpoint part's publish rows alone (no stack)",
    )
    ap.add_argument("--calls", type=int, default=0, help="control calls per run and path")
    ap.add_argument("--runs", type=int, default=5, help="runs per cell (>= 5 for the README)")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the method")
    ap.add_argument("--json", type=Path, default=Path("bench.json"), help="results file")
    ap.add_argument("--soak-calls", type=int, default=0, help="soak control calls (10,000)")
    ap.add_argument("--soak-streams", type=int, default=16)
    args = ap.parse_args(argv)
    parts = order(list(args.parts))
    logging.basicConfig(level=logging.INFO, format="bench %(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log = logging.getLogger("bench")
    tmp = Path(tempfile.mkdtemp(prefix="rollbus-bench-"))
    server = natsd.start(tmp / "nats", port=0)
    t_start = time.time()
    load = [round(x, 2) for x in os.getloadavg()]
    runs, quick = args.runs, args.quick
    tables: list[Table] = []
    out: list[str] = []
    failed: list[str] = []
    ctx = {"tmp": tmp, "url": server.url, "runs": runs, "quick": quick, "args": args,
           "nats_pid": server.proc.pid}
    try:
        for part in parts:
            # a part that fails is reported and the others still run: bench.json keeps
            # what was measured, and the exit code says something failed
            try:
                got = run_part(part, ctx)
            except Exception as e:  # noqa: BLE001 - reported below and in bench.json
                log.exception("part %s FAILED", part)
                failed.append(f"{part}: {type(e).__name__}: {str(e).strip()[:500]}")
                continue
            if isinstance(got, str):
                out.append(got)
            else:
                tables += got
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "meta": {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
            "command": " ".join(["python -m tests.bench", *(argv if argv is not None
                                                             else sys.argv[1:])]),
            "runs": runs,
            "quick": quick,
            "load_avg": load,
            "cpus": os.cpu_count(),
            "seconds": round(time.time() - t_start, 1),
            "failed": failed,
        },
        "tables": [t.to_json() for t in tables],
    }
    args.json.write_text(json.dumps(doc, indent=1))
    print(report.render(doc))
    print("\n".join(out))
    for line in missed(doc["tables"]):
        print(line)
    for line in failed:
        print(f"FAILED: part {line}")
    print(f"wrote {args.json} ({doc['meta']['seconds']} s); README: "
          f"python -m tests.bench.report {args.json} --readme README.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
