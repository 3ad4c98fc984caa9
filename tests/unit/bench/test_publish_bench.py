"""The publish benchmark's raw baseline is like with like: the very bytes the SDK
publishes, 1 MiB messages, into a stream configured as the checkpoint bucket's."""

from __future__ import annotations

import os
from typing import Any

import nats
import pytest

from shared import objstore
from tests.bench import checkpoint

MIB = 1 << 20


async def test_raw_baseline_sends_the_same_bytes_into_a_stream_like_the_buckets(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    nc = await nats.connect(nats_url)
    try:
        await objstore.ensure_bucket(nc, checkpoint.BUCKET)
        js = nc.jetstream()
        await js.add_stream(name=checkpoint.RAW_STREAM, subjects=[checkpoint.RAW_SUBJECT])
        blobs = [os.urandom(2 * MIB + 5), os.urandom(MIB - 3)]
        sent: list[bytes] = []
        real = nats.aio.client.Client.publish

        async def spy(self: Any, subject: str, payload: Any = b"", **kw: Any) -> None:
            if subject == checkpoint.RAW_SUBJECT:
                sent.append(bytes(payload))
            await real(self, subject, payload, **kw)

        monkeypatch.setattr(nats.aio.client.Client, "publish", spy)
        assert await checkpoint.raw_js_publish(nats_url, blobs) > 0
        # 1 MiB messages, the last of each blob shorter, as our chunks: the same bytes
        assert [len(m) for m in sent] == [MIB, MIB, 5, MIB - 3]
        assert b"".join(sent) == b"".join(blobs)
        want = (await js.stream_info(f"OBJ_{checkpoint.BUCKET}")).config.as_dict()
        got = (await js.stream_info(checkpoint.RAW_STREAM)).config.as_dict()
        for k in ("name", "subjects"):
            want.pop(k), got.pop(k)
        assert got == want  # storage, replicas, limits, discard, direct get, rollup
    finally:
        await nc.close()
