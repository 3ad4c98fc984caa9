"""Raw nats-py responders: the baseline peers of the benchmarks.

``python -m tests.bench.responder URL SUBJECT N [FIRST]`` answers SUBJECT with N
responders on their own connections, ranks FIRST..FIRST+N-1, each in queue group
``rank<i>`` (a scatter reaches every rank). The control benchmark starts one process per
responder (N=1), as rollbus runs one process per rank."""

from __future__ import annotations

import asyncio
import sys

import nats


async def main(url: str, subject: str, n: int, first: int = 0) -> None:
    conns = []
    for i in range(first, first + n):
        nc = await nats.connect(url)

        async def answer(msg, i=i, nc=nc):  # noqa: ANN001
            await nc.publish(msg.reply, b'{"ok":true}', headers={"Rollbus-Rank": str(i)})

        await nc.subscribe(subject, queue=f"rank{i}", cb=answer)
        await nc.flush()
        await nc.flush()  # nats-py: the first flush can return before the server saw the SUB
        conns.append(nc)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], int(a[2]), int(a[3]) if len(a) > 3 else 0))
