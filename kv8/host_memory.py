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

After loading, :func:`release_free_heap` (glibc's ``malloc_trim(0)``) hands back to the kernel the free pages that
loading left in the heap: a weight converted at load (GGUF blocks regrouped for the kernel, FP8 codes, packed bf16
panels) passes through transient copies below the mmap threshold, and the holes they leave between the weights that
stay are not at the heap's top, so neither the trim threshold nor glibc's own trimming returns them. The loader calls
it after each layer's conversion: with the random 8B Q4_K file of ``scripts/write_random_gguf.py`` (4.2 GiB of blocks)
the loaded process held 5.6 GiB without it, 4.7 GiB with one call at the end, and peaked at 6.1 / 5.4 GiB without /
with the call per layer. Activations allocated later fault in their own pages.

Huge pages for the weights, with ``KV8_HUGE_PAGES=1`` (off by default). Why: a decode step streams every weight
(hundreds of MB) -- on 4 KiB pages a TLB miss and a page walk (two-dimensional in a virtual machine) every 4 KiB.
:func:`huge_page_empty` maps memory itself (anonymous ``mmap``, 2 MiB aligned) and asks the kernel to back it with
transparent huge pages (``madvise(MADV_HUGEPAGE)``, which Linux honours where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``); :func:`place_on_huge_pages` moves a
loaded model's parameters and buffers into one such region, so their pages are faulted in at load. Measured with
SmolLM2-135M (docs/benchmarks.md, "Host memory: 2 MiB pages"): decode steps of one engine 1.05-1.08x faster (bf16
weights) and 1.01-1.02x (FP8 weights) than with the same weights on 4 KiB pages; but loading takes ~0.7 s longer
(a 2 MiB page the machine has not used before costs several times its 512 small pages to fault in, on the
virtual machine measured), and in the peers benchmark's worker processes prefill with bf16 weights came out
0.87-0.91x at B = 1 and 32 with no decode gain beyond that run's noise -- not settled, hence opt-in. The KV cache
stays on ordinary, lazily faulted pages: it is first touched while serving. Contents and layout of every tensor
are unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import platform
from collections.abc import Sequence

import torch
from torch import nn

from kv8 import envs

logger = logging.getLogger("kv8")

__all__ = ["HUGE_PAGE", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "huge_page_bytes", "huge_page_empty", "place_on_huge_pages",
           "release_free_heap",
           "tune_malloc"]

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


def release_free_heap() -> bool:
    """glibc's ``malloc_trim(0)``: give every whole free page of the heap back to the kernel (see the module
    docstring). True when glibc released memory; False when it had none to release, or the C library is not glibc.
    Never raises."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


HUGE_PAGE = 2 << 20   # bytes: x86-64's transparent huge page
_ALIGN = 64           # bytes: each tensor's start within a region placed by place_on_huge_pages


def huge_page_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` (contiguous, contents undefined), starting on a 2 MiB boundary of an
    anonymous mapping advised ``MADV_HUGEPAGE`` when it is at least one huge page and ``KV8_HUGE_PAGES=1``;
    otherwise a plain ``torch.empty``. The mapping lives as long as the tensor or any view of it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not envs.huge_pages() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(tuple(shape), dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)   # keeps `region` alive
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError as exc:   # a kernel without transparent huge pages: the mapping still serves, on 4 KiB pages
        logger.debug("kv8: madvise(MADV_HUGEPAGE) refused (%s); ordinary pages", exc)
    return raw[start:start + nbytes].view(dtype).view(tuple(shape))


def place_on_huge_pages(module: nn.Module) -> int:
    """Move ``module``'s parameters and buffers into one :func:`huge_page_empty` region (each at a 64-byte
    boundary, contents and shapes unchanged, the same tensor objects: ``.data`` is swapped, so tied parameters stay
    tied); returns the bytes moved (0 unless ``KV8_HUGE_PAGES=1``, or when they are less than one huge page).
    Tensors that share storage with another tensor, or are views into a larger one, stay where they are."""
    if not envs.huge_pages():
        return 0
    owners: dict[int, list[torch.Tensor]] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type == "cpu" and not t.is_meta and t.numel():
            owners.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    movable = [ts[0] for ts in owners.values()
               if len(ts) == 1 and ts[0].is_contiguous() and ts[0].storage_offset() == 0
               and ts[0].untyped_storage().nbytes() == ts[0].numel() * ts[0].element_size()]
    sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in movable]
    if sum(sizes) < HUGE_PAGE:
        return 0
    region = huge_page_empty((sum(sizes),), torch.uint8)
    offset = 0
    for t, size in zip(movable, sizes):
        view = region[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        t.data = view
        offset += size
    return offset


def huge_page_bytes(address: int) -> int | None:
    """Bytes of the mapping that holds ``address`` that the kernel backs with transparent huge pages now
    (``AnonHugePages`` of ``/proc/self/smaps``); None where that file is unreadable or no mapping holds it. Pages
    are granted as they are first touched."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):   # a mapping's first line: "start-end perms ..."
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
