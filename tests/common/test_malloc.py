"""A fixed mmap threshold: blocks above it are mapped (and returned on free) even after glibc has seen
bigger blocks freed, where by default the threshold would have grown past them.

Each case runs in a fresh interpreter (malloc's settings are the process's), measuring with glibc's
`mallinfo2().hblkhd`, the bytes held in mapped blocks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.malloc import MAX_MMAP_THRESHOLD, set_mmap_threshold

LIBC = """
import ctypes, resource, sys, threading
from services.common.malloc import keep_freed, set_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
"""

PROBE = (
    LIBC
    + """
if sys.argv[1] == "fixed":
    assert set_mmap_threshold(1 << 20)
libc.free(libc.malloc(16 << 20))  # a mapped block freed: glibc's dynamic threshold rises past 16 MiB
before = libc.mallinfo2().hblkhd
block = libc.malloc(8 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(block)
"""
)


def _mapped_growth(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_fixed_threshold_keeps_big_blocks_mapped() -> None:
    assert _mapped_growth("dynamic") == 0  # the 8 MiB block came from the heap, which keeps it
    assert _mapped_growth("fixed") >= 8 << 20  # mapped: returned to the system on free


@pytest.mark.parametrize("nbytes", [0, -1, MAX_MMAP_THRESHOLD + 1])
def test_a_size_glibc_refuses_is_refused(nbytes: int) -> None:
    with pytest.raises(ValueError, match="mmap threshold"):
        set_mmap_threshold(nbytes)


KEEP = (
    LIBC
    + """
if sys.argv[1] == "keep":
    assert keep_freed()
size = 96 << 20  # above glibc's largest mmap threshold and a thread arena's 64 MiB heap
out = []

def steps():  # on a thread of its own, as the learner's model thread is
    for _ in range(3):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        libc.memset(block, 1, size)  # touch every page
        mapped = libc.mallinfo2().hblkhd
        libc.free(block)
        out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, mapped))

thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(" ".join(f"{f},{m}" for f, m in out))
"""
)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_heap_that_keeps_freed_blocks_reuses_them_without_page_faults() -> None:
    """By default a thread's 96 MiB block is mapped on its own and faulted in afresh each time; with
    `keep_freed` it comes from the heap, and the same block again costs no page fault."""
    runs = {}
    for mode in ("default", "keep"):
        done = subprocess.run([sys.executable, "-c", KEEP, mode], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        runs[mode] = [tuple(int(x) for x in step.split(",")) for step in done.stdout.split()]
    pages = (96 << 20) // 4096
    assert all(mapped >= 96 << 20 and faults >= pages // 2 for faults, mapped in runs["default"])
    assert all(mapped < 96 << 20 for _, mapped in runs["keep"])  # the block is not mapped
    assert all(faults < pages // 100 for faults, _ in runs["keep"][1:])  # reused: no page faulted in
