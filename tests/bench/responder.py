"""Raw nats-py responders in their own process: the baseline peers of the benchmarks.

``python -m tests.bench.responder URL SUBJECT N`` answers SUBJECT with N responders, each
on its own connection and queue group ``rank<i>`` (a scatter reaches all N)."""

from __future__ import annotations

import asyncio
import sys

import nats


async def main(url: str, subject: str, n: int) -> None:
    conns = []
    for i in range(n):
        nc = await nats.connect(url)

        async def answer(msg, i=i, nc=nc):  # noqa: ANN001
            await nc.publish(msg.reply, b'{"ok":true}', headers={"Rollbus-Rank": str(i)})

        await nc.subscribe(subject, queue=f"rank{i}", cb=answer)
        await nc.flush()
        conns.append(nc)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
