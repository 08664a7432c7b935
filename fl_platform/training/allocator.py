"""Keep large freed blocks in the process heap, so cohort training does not page-fault every step.

glibc serves allocations above its mmap threshold (128 KiB at start, raised dynamically) with
fresh ``mmap`` pages and unmaps them when freed; every reuse then faults each 4 KiB page in
again. A cohort of 100 clients of a 53k-parameter CNN allocates tensors of about 21 MB several
times a step, and on a 2-core VM those faults cost up to a third of a vectorised round, with a
large spread from run to run (digits CNN at 1,000/100: median round 40-75 ms with glibc's
defaults, 38-40 ms with the settings below, measured in one session). The usual advice for
PyTorch on CPU is to preload jemalloc or tcmalloc; ``mallopt`` gets the same effect for blocks
up to 32 MiB (glibc's maximum threshold on 64-bit) from inside the process, without a launcher.

Process-wide and idempotent. Applied by the cohort trainer (the sequential path's blocks are
small and already come from the heap). Freed memory up to ``TRIM_BYTES`` stays with the process
instead of going back to the OS, so RSS after a peak stays near the peak.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit
TRIM_BYTES = 256 << 20

_applied: bool | None = None


def keep_freed_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); False where there is no
    glibc ``mallopt`` (macOS, Windows, musl), which changes speed only."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            _applied = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1)
        except (OSError, AttributeError) as err:
            log.debug("mallopt unavailable (%s): large blocks stay mmapped", err)
    return _applied
