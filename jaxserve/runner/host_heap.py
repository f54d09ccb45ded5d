"""Keeps freed host memory in the C heap, for XLA:CPU's per-execution temporaries.

XLA:CPU allocates the temporaries of each execution of a program as one block (25-40 MB for a
batch-32 decode step of the default model: logits, their sampler-bucket padding, the sampler's
work arrays) and frees it when the execution ends. glibc serves a block that large with a fresh
mmap and unmaps it on free, so every step faults its pages in again (~6,300 minor faults, 25 MB
of pages zeroed by the kernel: ~8% of a batch-32 decode step on a 2-core CPU). Raising glibc's
mmap and trim thresholds keeps such blocks in the heap, where the next step finds them. The
price is that the process keeps its peak heap rather than returning freed blocks to the system,
which a server running the same steps again and again needs anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap and stay there when freed


@functools.cache
def keep_freed_blocks() -> bool:
    """Set glibc's mmap and trim thresholds to THRESHOLD (once per process). False, with
    nothing changed, where the C library has no mallopt (not glibc) or refuses a value."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, THRESHOLD) == 1
    if not done:
        logger.warning("mallopt refused the heap thresholds: XLA:CPU steps will fault their temporaries in")
    return done
