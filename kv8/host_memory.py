"""glibc malloc settings for an engine process: activations reuse freed memory instead of faulting in fresh pages.

Why: a prefill step allocates and frees activations of several MiB per layer (a 2,048-token gate/up projection is
12 MiB). glibc serves an allocation above its mmap threshold (128 KiB at start, raised on each free of an mmapped
block up to 32 MiB) with new pages from ``mmap`` and returns them on free, and it gives the top of its heap back to
the kernel once more than ``M_TRIM_THRESHOLD`` is free there (128 KiB at start, then twice the raised mmap
threshold). Each step then faults in zeroed pages again. Measured with SmolLM2-135M (docs/benchmarks.md, "Host
memory: glibc's malloc settings", ``benchmarks/bench_host_memory.py``): prefill of 8 x 1,024 tokens 1.07-1.15x and
of 32 x 1,024 tokens 1.08-1.10x faster with the settings below; of 1 x 1,024 tokens, whose activations glibc's
adaptive threshold already keeps, within 3-4%. vLLM's CPU guide gets the same effect by preloading tcmalloc.

What :func:`tune_malloc` sets, through ``mallopt``: ``M_MMAP_THRESHOLD`` 32 MiB (the most it takes on 64-bit
glibc; larger blocks, such as the KV cache, are still mmapped) and ``M_TRIM_THRESHOLD`` 1 GiB (free memory on
top of the heap stays for the next step). The cost is that the process keeps the peak of its freed activation
memory, which ``max_num_batched_tokens`` bounds.

Invariants: it changes nothing where the C library is not glibc, nor where the user chose glibc's malloc
settings (``GLIBC_TUNABLES`` naming ``glibc.malloc``, or any ``MALLOC_*_`` variable): an explicit setting wins.
It runs at most once per process and never raises; :func:`tune_malloc` says what it did.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

from kv8 import envs

logger = logging.getLogger("kv8")

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]

M_TRIM_THRESHOLD = -1   # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # bytes; the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 1 << 30


@functools.cache
def tune_malloc() -> str:
    """Apply the settings above to this process once; returns what was done (``"set"`` or why not)."""
    if platform.libc_ver()[0] != "glibc":
        return "not glibc"
    if (name := envs.user_malloc_setting()) is not None:
        return f"left to {name}"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "no mallopt"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        logger.warning("kv8: glibc's mallopt refused the allocator settings; activations are allocated as before")
        return "refused"
    return "set"
