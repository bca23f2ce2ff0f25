"""Attention backends: one interface, a reference implementation, room for fast kernels.

A backend is called once per layer with the batch's new q/k/v. It must (1) store the new K/V of *all*
sequences into their slots (quantize-on-store), and only then (2) let every query attend over the stored
context. Step (1) before (2) is what makes a block written by one sequence in this step readable by another
(prefix sharing) and makes chunked, cached and uncached prefill read identical bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from kv8.attention.cpu_fused import FusedCPUBackend
from kv8.attention.metadata import AttentionMetadata
from kv8.attention.reference import paged_attention_reference
from kv8.cache.paged_cache import PagedKVCache
from kv8.kernels.cpu.build import KernelUnavailable
from kv8.platform import CPU, Platform

logger = logging.getLogger("kv8")


class AttentionBackend(Protocol):
    name: str

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache,
                layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` -> output ``[T, Hq, D]``."""
        ...


class ReferenceBackend:
    """Plain torch: store with :meth:`PagedKVCache.store`, attend with the reference loop."""

    name = "reference"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache,
                layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        cache.store(layer, key, value, meta.slot_mapping)
        return paged_attention_reference(query, cache, layer, meta, scale)


def _triton_backend(platform: Platform) -> AttentionBackend:
    from kv8.attention.triton import TritonBackend  # imports Triton: only when the backend is chosen

    return TritonBackend(platform)


# each backend made for the platform it runs on (the triton backend's kernels read its FP8 conversions and SMs)
BACKENDS: dict[str, Callable[[Platform], AttentionBackend]] = {
    "cpu_fused": lambda platform: FusedCPUBackend(), "reference": lambda platform: ReferenceBackend(),
    "triton": _triton_backend}
CPU_ONLY_BACKENDS = ("cpu_fused",)   # the others run on every device (triton: CUDA, or the CPU in its interpreter)

_auto_fallback_warned = False


def get_backend(name: str, platform: Platform = CPU) -> AttentionBackend:
    """The backend named ``name`` on ``platform``. ``auto`` is the platform's
    (:attr:`kv8.platform.Platform.attention_backend`): ``triton`` on CUDA; on the CPU ``cpu_fused`` when its
    kernels build and load, else ``reference`` (with one warning per process saying why). Naming ``cpu_fused``
    explicitly raises :class:`KernelUnavailable` instead."""
    global _auto_fallback_warned
    if name == "auto" and platform.attention_backend != "cpu_fused":
        name = platform.attention_backend
    if name == "auto":
        try:
            return FusedCPUBackend()
        except KernelUnavailable as exc:
            if not _auto_fallback_warned:
                _auto_fallback_warned = True
                logger.warning("attention backend: using the slow reference path because the fused CPU kernels "
                               "are unavailable: %s", str(exc))
            return ReferenceBackend()
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not known; choose one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name](platform)
