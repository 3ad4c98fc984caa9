"""``services.worker.control.rss_bytes``: the rank's RSS on every ``status``, read afresh
through an fd kept open (one pread, no open/close per call): never a cached value."""

from __future__ import annotations

import mmap
import os

from services.worker.control import rss_bytes


def _statm_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_rss_is_read_afresh_on_every_call() -> None:
    before = rss_bytes()
    assert abs(before - _statm_rss()) < 16 << 20
    size = 64 << 20
    buf = mmap.mmap(-1, size)
    try:
        for off in range(0, size, mmap.PAGESIZE):
            buf[off] = 1  # touched: resident
        grown = rss_bytes()
        assert grown - before >= size * 0.9, (before, grown)
    finally:
        buf.close()
    assert rss_bytes() < grown - size * 0.9  # unmapped: down again, seen at once
