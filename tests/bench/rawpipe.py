"""Raw core-NATS 1 MiB publish→subscribe throughput between two nats-py processes:
the wire baseline of the checkpoint benchmark.

``python -m tests.bench.rawpipe sub URL SUBJECT N`` prints ``ready``, then one JSON line
``{"mib_s", "t0", "t1", "bytes", "cpu_s"}`` for N 1 MiB messages (``t0``/``t1``:
``time.monotonic()`` at the first and the last message, comparable across processes on
one host; ``cpu_s``: the subscriber process's CPU seconds from ready to the last message);
``... pub URL SUBJECT N [--wait]`` sends them (``--wait``: after connecting, print
``ready`` and wait for a line on stdin, so several flows start together). What is in
flight is bounded to 32 MiB with credits (the subscriber grants 8 more messages after
every 8 it reads), as any reader must: the server silently drops a client with more than
64 MiB pending.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time

import nats

MIB = 1 << 20
WINDOW = 32
GRANT = 8


async def pub(url: str, subject: str, n: int) -> None:
    nc = await nats.connect(url, pending_size=256 * MIB)
    credit = asyncio.Semaphore(WINDOW)
    finished = asyncio.Event()

    async def on_credit(msg) -> None:  # noqa: ANN001
        if msg.data == b"done":
            finished.set()
            return
        for _ in range(int(msg.data)):
            credit.release()

    await nc.subscribe(subject + ".credit", cb=on_credit)
    await nc.flush()
    await nc.flush()  # nats-py: the first flush can return before the server saw the SUB
    data = os.urandom(MIB)
    if "--wait" in sys.argv:  # several publishers start together
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for _ in range(n):
        await credit.acquire()
        await nc.publish(subject, data)
    await nc.flush()
    # stay connected until the subscriber has every message: closing right after the
    # flush lost the last few messages now and then
    loop = asyncio.get_running_loop()
    loop.call_later(120, finished.set)
    await finished.wait()
    await nc.close()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def sub(url: str, subject: str, n: int) -> None:
    nc = await nats.connect(url)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()
    got = 0
    t0 = 0.0

    async def on_msg(msg) -> None:  # noqa: ANN001
        nonlocal got, t0
        if got == 0:
            t0 = time.monotonic()
        got += 1
        if got % GRANT == 0:
            await nc.publish(subject + ".credit", str(GRANT).encode())
        if got == n:
            done.set_result(time.monotonic())
            await nc.publish(subject + ".credit", b"done")

    await nc.subscribe(subject, cb=on_msg, pending_bytes_limit=128 * MIB)
    await nc.flush()
    await nc.flush()  # nats-py: the first flush can return before the server saw the SUB
    c0 = _cpu()
    print("ready", flush=True)
    # a watchdog without wait_for (which, here, kept the reader from running)
    loop.call_later(60, lambda: done.done() or done.set_exception(TimeoutError()))
    try:
        t1 = await done
    except TimeoutError:
        print(json.dumps({"error": f"got {got} of {n} messages in 60 s"}), flush=True)
        sys.exit(1)
    # the first message starts the clock: n-1 messages were timed
    out = {"mib_s": (n - 1) / (t1 - t0), "t0": t0, "t1": t1, "bytes": n * MIB,
           "cpu_s": _cpu() - c0}
    print(json.dumps(out), flush=True)
    await nc.close()


if __name__ == "__main__":
    mode, url, subject, count = sys.argv[1:5]
    asyncio.run((pub if mode == "pub" else sub)(url, subject, int(count)))
