"""Keep freed memory in the process on CPU (glibc): each training step's large temporaries are reused, not returned.

By default glibc serves every allocation above 128 KiB-32 MiB with its own `mmap` and gives it back on `free`, and
trims the heap top past 128 KiB. A training step allocates and frees the same large activations every time, so each
step page-faults them in again (zeroed pages): about 250k minor faults per forward + backward of one S4 layer at
L=1024 here. Raising both thresholds keeps those blocks for the next step. Measured on 2 cores: the quick-start loop
128 s -> 105 s with the same result and the same peak memory (docs/explanation/measured.md). The command line
applies it to `s4accel train`; a program calling `s4accel.train()` decides for itself (or sets
`MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` in the environment). `S4ACCEL_KEEP_MALLOC=1` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest accepted value on 64-bit
_TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process. True if both were applied; False elsewhere (not
    Linux/glibc, turned off by `S4ACCEL_KEEP_MALLOC=1`, or set by the user's own `MALLOC_*` variables)."""
    if sys.platform != "linux" or os.environ.get("S4ACCEL_KEEP_MALLOC") == "1":
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")):
        return False  # the user chose the allocator's settings (or another allocator)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
