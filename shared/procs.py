"""Whether a process another rollbus process reported is still there, when both run in
the same pid space (same boot of the same host, same pid namespace).

A worker rank reports its pid and :func:`pid_space`; the engine, when it shares that
space, sees a killed rank at once (:func:`gone`) instead of after the status bound.
"""

from __future__ import annotations

import os
from functools import cache


@cache
def pid_space() -> str:
    """``<boot id>/<pid namespace>`` of this process; "" when unknown (no /proc)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def gone(pid: int) -> bool:
    """Process ``pid`` of our pid space has exited (no such process, or a zombie waiting
    for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
