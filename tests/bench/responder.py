"""Raw nats-py responders: the baseline peers of the benchmarks.

``python -m tests.bench.responder URL SUBJECT N [FIRST] [--size B] [--relay SUBJ K]``
answers SUBJECT with N responders on their own connections, ranks FIRST..FIRST+N-1, each
in queue group ``rank<i>`` (a scatter reaches every rank). The control benchmark starts
one process per responder (N=1), as rollbus runs one process per rank.

``--size B``: every reply is B bytes (a JSON object padded with spaces), the size of the
rollbus reply it stands for (like with like: the same message size).
``--relay SUBJ K``: a raw "engine": each request is answered only after a raw
scatter-gather on SUBJ to K responders (its own inbox, every answer awaited) — the same
two hops and the same processes as a rollbus call that asks every rank (client → engine,
engine → every rank)."""

from __future__ import annotations

import asyncio
import sys

import nats


def padded(size: int) -> bytes:
    body = b'{"ok":true}'
    return body + b" " * max(0, size - len(body))


async def main(url: str, subject: str, n: int, first: int = 0, size: int = 0,
               relay: tuple[str, int] | None = None) -> None:
    conns = []
    body = padded(size)
    for i in range(first, first + n):
        nc = await nats.connect(url)
        if relay is None:

            async def answer(msg, i=i, nc=nc):  # noqa: ANN001
                await nc.publish(msg.reply, body, headers={"Rollbus-Rank": str(i)})

        else:
            scat, k = relay
            inbox = nc.new_inbox()
            got: asyncio.Queue[object] = asyncio.Queue()

            async def on_reply(msg, got=got):  # noqa: ANN001
                got.put_nowait(msg)

            await nc.subscribe(inbox, cb=on_reply)
            lock = asyncio.Lock()

            async def answer(msg, nc=nc, inbox=inbox, got=got, lock=lock,  # noqa: ANN001
                             scat=scat, k=k):
                async with lock:  # one scatter at a time: its answers are its own
                    while not got.empty():  # late answers of a scatter that timed out
                        got.get_nowait()
                    await nc.publish(scat, b"{}", reply=inbox)
                    for _ in range(k):
                        await asyncio.wait_for(got.get(), 5)
                await nc.publish(msg.reply, body)

        await nc.subscribe(subject, queue=f"rank{i}", cb=answer)
        await nc.flush()
        await nc.flush()  # nats-py: the first flush can return before the server saw the SUB
        conns.append(nc)
    print("ready", flush=True)
    await asyncio.Event().wait()


def parse(argv: list[str]) -> tuple[tuple[str, str, int, int], int, tuple[str, int] | None]:
    a = list(argv)
    size, relay = 0, None
    if "--size" in a:
        k = a.index("--size")
        size = int(a[k + 1])
        del a[k : k + 2]
    if "--relay" in a:
        k = a.index("--relay")
        relay = (a[k + 1], int(a[k + 2]))
        del a[k : k + 3]
    return (a[0], a[1], int(a[2]), int(a[3]) if len(a) > 3 else 0), size, relay


if __name__ == "__main__":
    pos, size_arg, relay_arg = parse(sys.argv[1:])
    asyncio.run(main(*pos, size=size_arg, relay=relay_arg))
