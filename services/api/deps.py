"""What every route needs: settings, the bus, metrics, and the one control call."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors

from services.api.metrics import Metrics
from shared import messages as m
from shared.bus import Bus
from shared.errors import BAD_REQUEST, ControlError
from shared.settings import Settings
from shared.subjects import Subjects


def bearer_ok(header: str, token: str) -> bool:
    """``header`` is ``Bearer <token>`` (the scheme in any case, as RFC 9110 says: ``bearer
    sekret`` too), the token compared in constant time (no early exit on the first
    differing byte, so response timing tells nothing about the token)."""
    scheme, _, got = header.strip().partition(" ")
    ok = hmac.compare_digest(got.strip().encode(), token.encode())
    return scheme.lower() == "bearer" and ok


# engine methods bounded by one CONTROL_TIMEOUT_S (an in-flight step at most): the API
# waits CONTROL_TIMEOUT_S + 5 s for them, twice that for the others (sleep, wakeup,
# update_weights: a scatter after the pause, or stage then commit)
ONE_HOP = frozenset({"pause", "resume", "is_paused", "status", "health", "model_config"})
# engine methods that only read: the engine records no caller for them (no audit event),
# so the API sends them without a ``Rollbus-Actor`` header (one header less to write and
# parse on the polled calls)
READS = frozenset({"is_paused", "status", "health", "model_config"})


@dataclass
class Deps:
    settings: Settings
    bus: Bus | None = None
    metrics: Metrics = field(default_factory=Metrics)
    current_version: str = ""  # last weight version seen in a reply (for empty outputs)
    # per-request work done once: the subjects, each method's latency histogram child
    _subjects: Subjects | None = field(default=None, init=False, repr=False)
    _latency: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def subjects(self) -> Subjects:
        s = self._subjects
        if s is None or s.instance != self.settings.instance:
            s = self._subjects = Subjects(self.settings.instance)
        return s

    async def control(
        self, method: str, data: bytes, rid: str, actor: str = "", timeout: float | None = None
    ) -> m.ControlReply:
        """Request ``ctl.<method>`` from the engine. Bus failures become a 503 reply."""
        assert self.bus is not None, "bus not connected"
        # an op may scatter twice (stage, then commit), each bounded by the control timeout;
        # the others wait for one step at most (pause, resume) or answer from the engine
        ct = self.settings.control_timeout_s
        t = timeout or (ct if method in ONE_HOP else 2 * ct) + 5.0
        latency = self._latency.get(method)
        if latency is None:
            latency = self._latency[method] = self.metrics.control_latency.labels(method)
        t0 = time.perf_counter()
        try:
            reply = await self.bus.request(
                self.subjects.ctl(method),
                data,
                timeout=t,
                request_id=rid,
                headers={"Rollbus-Actor": actor} if actor and method not in READS else None,
            )
        except ControlError as e:
            return m.ControlReply(rid, e.code, f"engine: {e.message}")
        except nats.errors.MaxPayloadError:
            # arguments that passed every check but do not fit one NATS message (a body
            # of 200k tags, or padded with whitespace): the client's to fix, never a 500
            return m.ControlReply(
                rid,
                BAD_REQUEST,
                f"control arguments too large for the bus ({len(data)} bytes; one NATS"
                f" message holds {self.bus.max_payload})",
                {"param": "body"},
            )
        finally:
            latency.observe(time.perf_counter() - t0)
        return m.json_decode(reply.data, type=m.ControlReply)
