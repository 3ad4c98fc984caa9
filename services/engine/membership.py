"""The engine's fleet membership record (``shared.fleet.Member``, README "Fleet").

:func:`run` (a supervised task) writes ``members.<instance>`` in the ``rollbus_fleet``
bucket at once and then every ``CONTROL_TIMEOUT_S / 3``; :func:`leave` deletes it on a
clean shutdown. A coordinator counts an instance whose record is fresh as a member even
when it misses the discovery ping (stopped, restarting, overloaded): its row is then
``unreachable`` and the transaction does not commit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from shared import fleet as f

log = logging.getLogger("rollbus.engine.membership")


def record(engine: Any, since: float) -> f.Member:
    s = engine.settings
    return f.Member(s.instance, s.served_model_name, os.getpid(), since, time.time())


async def run(engine: Any) -> None:
    bucket = f.FleetBucket(engine.bus.nc)
    period = f.member_period(engine.settings.control_timeout_s)
    since = time.time()
    failing = False
    while True:
        try:
            await bucket.put_member(record(engine, since))
            if failing:
                log.info("fleet member record written again")
            failing = False
        except Exception as e:  # noqa: BLE001 - NATS away: retry next period (not /health)
            if not failing:
                log.warning("cannot write the fleet member record (%r); retrying every %.1fs",
                            e, period)
            failing = True
        await asyncio.sleep(period)


async def leave(engine: Any) -> None:
    """Delete the record (clean shutdown): coordinators stop counting this instance."""
    try:
        await f.FleetBucket(engine.bus.nc).delete_member(engine.settings.instance)
    except Exception as e:  # noqa: BLE001 - the record then ages out of the window
        log.warning("cannot delete the fleet member record: %r", e)
