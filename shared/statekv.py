"""The engine's state bucket: a JetStream key-value bucket, one key per instance.

Only the I/O lives here (the engine's record and its encoding are in
``services.engine.persist``). Keys allow ``[-/_=.a-zA-Z0-9]`` only, so an instance name
is escaped with :func:`key_for`. File storage, history 1: a restarted nats-server on the
same store keeps the last record.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js import api
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from shared.objstore import replicas_for

STATE_BUCKET = "rollbus_state"
_SAFE = frozenset("-_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def key_for(instance: str) -> str:
    """An instance name as a KV key: safe characters kept, every other byte ``=XX``."""
    out = []
    for b in instance.encode():
        c = chr(b)
        out.append(c if c in _SAFE else f"={b:02X}")
    return "".join(out)


class StateBucket:
    """Get / put one instance's record; every call bounded by ``timeout`` seconds."""

    def __init__(self, nc: Client, instance: str, timeout: float = 2.0) -> None:
        self.nc, self.key, self.timeout = nc, key_for(instance), timeout
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            js = self.nc.jetstream(timeout=self.timeout)
            try:
                self._kv = await js.key_value(STATE_BUCKET)
            except (NotFoundError, BadRequestError):
                try:
                    self._kv = await js.create_key_value(
                        api.KeyValueConfig(
                            bucket=STATE_BUCKET,
                            history=1,
                            storage=api.StorageType.FILE,
                            replicas=replicas_for(self.nc),  # R3 on a cluster of >= 3
                        )
                    )
                except BadRequestError:  # created concurrently
                    self._kv = await js.key_value(STATE_BUCKET)
        return self._kv

    async def get(self) -> bytes | None:
        """The stored record, ``None`` if there is none. Raises on bus errors."""

        async def go() -> bytes | None:
            kv = await self._bucket()
            try:
                entry = await kv.get(self.key)
            except KeyNotFoundError:
                return None
            return entry.value or None

        return await asyncio.wait_for(go(), self.timeout)

    async def put(self, value: bytes) -> None:
        """Store the record (acked by JetStream). Raises on bus errors or timeout."""

        async def go() -> None:
            kv = await self._bucket()
            await kv.put(self.key, value)

        await asyncio.wait_for(go(), self.timeout)
