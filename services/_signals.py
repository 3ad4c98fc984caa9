"""Stop signals that arrive while ``rollbus serve`` is still importing.

``services.cli`` installs :func:`record` before its imports; the launcher then takes
over and treats a recorded signal as a stop request, so a Ctrl-C during start-up is a
clean stop, not a ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
received: list[int] = []


def record(signum: int, _frame: FrameType | None) -> None:
    received.append(signum)


def install() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, record)
