"""Keep freed CPU buffers in the process, as CUDA's caching allocator keeps GPU memory.

glibc serves a large block (a [256, 4096] float32 tensor is 4 MiB) with fresh pages from
the OS and may hand it back when it is freed; the kernel zeroes each fresh page on first
touch. Which allocations pay for that depends on the process's history (glibc moves its
thresholds as blocks come and go), so eager timings of the same code on a CPU move by up
to 30% from run to run and with the order of the variants, and a formulation that
allocates more buffers pays more of it. With both thresholds raised, freed blocks are
reused and the timings measure the kernels.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds to 1 GiB; False where that is not possible
    (another C library), and the timings then include the OS's page faults."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False
