"""glibc's malloc, tuned from inside the process: a fixed mmap threshold.

By default glibc serves an allocation above its mmap threshold (128 KiB at start) with a mapping of
its own, returned to the system on free, but it raises the threshold to the size of every such block
freed, up to 32 MiB. Once a learner has freed FSDP's gathered layers (~14 MB each for SmolLM2-135M)
and its activations, blocks of that size come from the heap instead and stay there after their free:
each rank's resident memory grows by what the heap keeps (docs/distributed-learner.md). A fixed
threshold (`mallopt(M_MMAP_THRESHOLD)`, the same as the MALLOC_MMAP_THRESHOLD_ environment variable)
stops the growth: blocks above it are always mapped and always returned.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # malloc.h
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc refuses larger values on 64-bit (HEAP_MAX_SIZE / 2)


def _glibc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # musl has no mallopt of this kind


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every allocation of `nbytes` or more from a mapping of its own, returned on free. False
    where the C library is not glibc (nothing changed); ValueError for a size glibc refuses."""
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"an mmap threshold must be in (0, {MAX_MMAP_THRESHOLD}] bytes, got {nbytes}")
    libc = _glibc()
    if libc is None:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) != 1:
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {nbytes}) failed")
    return True
