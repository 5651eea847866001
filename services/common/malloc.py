"""glibc's malloc, tuned from inside the process: a fixed mmap threshold, or a heap that keeps what is freed.

By default glibc serves an allocation above its mmap threshold (128 KiB at start) with a mapping of
its own, returned to the system on free, but it raises the threshold to the size of every such block
freed, up to 32 MiB. Once a learner has freed FSDP's gathered layers (~14 MB each for SmolLM2-135M)
and its activations, blocks of that size come from the heap instead and stay there after their free:
each rank's resident memory grows by what the heap keeps (docs/distributed-learner.md). A fixed
threshold (`mallopt(M_MMAP_THRESHOLD)`, the same as the MALLOC_MMAP_THRESHOLD_ environment variable)
stops the growth: blocks above it are always mapped and always returned.

The other way round (`keep_freed`), for a learner of one rank on the CPU: blocks above 32 MiB are always
mapped, whatever the threshold, and a worker thread's arena maps what its 64 MiB heaps cannot hold. So
every micro-batch's big activations (SmolLM2-135M: its [N, 49152] logits, their softmax and gradient,
~108 MB each) came from fresh mappings the kernel had to fault in and zero: ~0.9 million page faults
per train step (3.6 GB). With one arena, no mappings and no trimming, the heap keeps freed blocks and
serves the next step from them: 0 faults per step after the second, at ~4 % more resident memory.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
INT_MAX = 2**31 - 1  # mallopt's values are C ints
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
    return _mallopt((M_MMAP_THRESHOLD, nbytes))


def keep_freed() -> bool:
    """Serve every allocation from one heap (one arena, no mapping of its own for any block) and never
    give its free memory back to the system (no trimming), so freed blocks are reused without page
    faults. Call it before the process allocates much or starts threads. False where the C library is
    not glibc (nothing changed)."""
    return _mallopt((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, INT_MAX))


def _mallopt(*settings: tuple[int, int]) -> bool:
    """`mallopt(option, value)` for each pair; False where the C library is not glibc (nothing changed),
    OSError for a pair glibc refuses."""
    libc = _glibc()
    if libc is None:
        return False
    for option, value in settings:
        if libc.mallopt(option, ctypes.c_int(value)) != 1:
            raise OSError(f"mallopt({option}, {value}) failed")
    return True
