"""The worker's model keeps the heap's free top for the next step's temporaries, so a
step's freed activations come back without page faults (a 16 x 16-token prefill of the
bench model took 3-8 thousand faults a rank; docs/generation-speed-log.md, session 13)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc")

# 48 MiB in 64 KiB blocks (below any mmap threshold: always from the heap), touched,
# freed, then allocated and touched again: the faults of the second round are printed.
CHURN = """
import ctypes, resource, sys
if sys.argv[1] == "model":
    import services.worker.model  # noqa: F401
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
block, n = 64 << 10, 768
def round_():
    ps = [libc.malloc(block) for _ in range(n)]
    for p in ps:
        ctypes.memset(p, 1, block)
    for p in reversed(ps):
        libc.free(p)
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def test_freed_step_temporaries_are_reused_without_page_faults() -> None:
    # glibc's own policy gives the 48 MiB back and faults them in again (~12k pages);
    # with the model imported the freed heap top is kept
    assert _faults("plain") > 6000
    assert _faults("model") < 600
