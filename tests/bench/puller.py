"""One object-store pull in its own process, as a rank does it: the process-level peer of
:mod:`tests.bench.rawpipe` in the pull benchmark.

``python -m tests.bench.puller URL BUCKET NAME [SHA256]`` connects, prints ``ready``,
waits for a line on stdin (so several pullers start together), reads the object with
:func:`shared.objstore.read_object` (verifying SHA256 when given) and prints one JSON
line ``{"mib_s", "t0", "t1", "bytes", "cpu_s"}`` (``time.monotonic()``, comparable
across processes; ``cpu_s``: this process's CPU seconds, all threads, from ``t0`` to
``t1``). ``stock`` as the fourth argument uses nats-py's ``ObjectStore.get`` (it
concatenates the chunks: quadratic in size), ``stock-into`` the same with
``writeinto=BytesIO`` (its linear path);
``--nats-py`` makes our reader read through nats-py (no :mod:`shared._fastwire`)."""

from __future__ import annotations

import asyncio
import io
import json
import resource
import sys
import time

from shared import objstore
from shared.bus import Bus

MIB = 1 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def main(url: str, bucket: str, name: str, sha: str | None) -> None:
    bus = await Bus.connect(url, "bench-puller")
    try:
        await bus.flush()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        c0, t0 = _cpu(), time.monotonic()
        if sha == "stock":
            store = await bus.nc.jetstream().object_store(bucket)
            n = len((await store.get(name)).data or b"")
        elif sha == "stock-into":  # nats-py's linear path: chunks written to a file object
            store = await bus.nc.jetstream().object_store(bucket)
            sink = io.BytesIO()
            await store.get(name, writeinto=sink)
            n = sink.tell()
        else:
            buf = await objstore.read_object(bus.nc, bucket, name, expect_sha256=sha,
                                             fast="--nats-py" not in sys.argv)
            n = len(buf)
        t1, c1 = time.monotonic(), _cpu()
        print(json.dumps({"mib_s": n / MIB / (t1 - t0), "t0": t0, "t1": t1, "bytes": n,
                          "cpu_s": c1 - c0}), flush=True)
    finally:
        await bus.close()


if __name__ == "__main__":
    a = [x for x in sys.argv[1:] if x != "--nats-py"]
    asyncio.run(main(a[0], a[1], a[2], a[3] if len(a) > 3 else None))
