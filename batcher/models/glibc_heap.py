"""glibc's heap around a model load: its mmap threshold low while loading and higher while
serving, and the pages loading freed handed back to the OS."""

from __future__ import annotations

import ctypes
import os
import sys

# glibc's mallopt parameters: the size from which a block gets a mapping of its own, and how much
# free memory at the top of the heap it keeps.
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1
# While loading: glibc's initial 128 KiB, so the weights' load-time temporaries are unmapped when
# freed. While serving: 1 MiB, so a step's small activations are reused from the heap (no page
# faults) while logits and large prefill blocks are returned when freed.
LOAD_MMAP_THRESHOLD = 128 * 1024
SERVE_MMAP_THRESHOLD = 1024 * 1024


def set_mmap_threshold(size: int) -> None:
    """Fix glibc's mmap threshold at `size` bytes (and its trim threshold at twice that, the ratio
    glibc keeps itself). By default the threshold rises to the size of each large block freed (up
    to 32 MiB), after which blocks of that size (load-time weights; logits and activations of big
    steps) come from the heap and their pages stay resident once freed. Measured on the bundled
    model, int4 without dense copies, one server after one request: 450-470 MiB resident by
    default, 427 MiB with 128 KiB while loading only, 393 MiB with 1 MiB after it; the 1 MiB
    threshold kept the decode step's CPU time (batch 1 and 32) and cost a 256-token prefill about
    4% (`BENCHMARKS.md`). Left alone when MALLOC_MMAP_THRESHOLD_ sets it from the environment."""
    if sys.platform != "linux" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, size)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * size)
    except (OSError, AttributeError):  # not glibc
        pass


def release_free_memory() -> None:
    """Hand the heap pages freed by loading back to the OS. glibc keeps freed blocks below its
    mmap threshold (which rises to 32 MiB as large tensors are freed) in the heap, so a load that
    made and dropped dense tensors would otherwise stay resident at its peak."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass
