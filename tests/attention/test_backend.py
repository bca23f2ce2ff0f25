"""The attention backends (:mod:`kv8.attention.backend`, :mod:`kv8.attention.cpu_fused`): ``auto`` picks the fused
CPU backend, which stores and attends like the reference backend, falls back to the reference with one warning where
the kernels cannot be built, and reports a bad block id or slot as a ``ValueError``."""

from __future__ import annotations

import logging

import pytest
import torch

import kv8.attention.backend as backend_mod
import kv8.attention.cpu_fused as fused_backend
from kv8.attention.backend import FusedCPUBackend, ReferenceBackend, get_backend
from kv8.attention.metadata import AttentionMetadata
from kv8.cache.paged_cache import CacheShape
from kv8.kernels.cpu import attention as kernels
from kv8.kernels.cpu.attention import KernelUnavailable
from kv8.quant.formats import resolve_kv_cache_dtype
from tests.helpers.kernels import (
    TOL,
    cpu_has_fast_path,
    load_or_skip,
    make_cache,
    make_case,
    make_scales,
    random_kv,
    stored,
)


@pytest.fixture(scope="module")
def lib() -> kernels.KernelLibrary:
    lib = load_or_skip()
    assert lib.has_fast_path == cpu_has_fast_path(), "-march=native must enable the fast path exactly when the CPU can"
    return lib


def test_backend_forward_matches_reference_backend(lib: kernels.KernelLibrary) -> None:
    gen = torch.Generator().manual_seed(5)
    heads, group, dim, bs = 2, 3, 64, 16
    kv = resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16)
    scales = make_scales("fp8_e4m3", "head", 1, heads, dim, gen)
    shape = CacheShape(1, 12, heads, bs, dim)
    caches = [make_cache(shape, kv, scales) for _ in range(2)]
    tables = [[3, 7, 1], [0, 2]]
    fused_backend, reference = get_backend("auto"), ReferenceBackend()
    assert isinstance(fused_backend, FusedCPUBackend) and fused_backend.name == "cpu_fused"
    # Prefill both sequences in one step, then one decode step each: outputs and cache bytes agree.
    for query_lens, seq_lens in (([40, 20], [40, 20]), ([1, 1], [41, 21])):
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs)
        t = sum(query_lens)
        q = torch.randn(t, heads * group, dim, generator=gen).to(torch.bfloat16)
        k = random_kv(t, heads, dim, gen).to(torch.bfloat16)
        v = random_kv(t, heads, dim, gen).to(torch.bfloat16)
        want = reference.forward(q, k, v, caches[0], 0, meta, dim ** -0.5).float()
        got = fused_backend.forward(q, k, v, caches[1], 0, meta, dim ** -0.5).float()
        assert (got - want).abs().max().item() <= TOL[torch.bfloat16] * (1 + want.abs().max().item())
        for a, b in zip(stored(caches[0], 0, meta.slot_mapping), stored(caches[1], 0, meta.slot_mapping)):
            assert torch.equal(a, b)


def test_auto_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def unavailable() -> kernels.KernelLibrary:
        raise KernelUnavailable("no C++ compiler: 'g++' is not on PATH")

    monkeypatch.setattr(fused_backend, "load_kernels", unavailable)
    monkeypatch.setattr(backend_mod, "_auto_fallback_warned", False)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        first, second = get_backend("auto"), get_backend("auto")
    assert first.name == second.name == "reference"
    warnings = [r for r in caplog.records if "reference" in r.getMessage()]
    assert len(warnings) == 1 and "not on PATH" in warnings[0].getMessage()
    with pytest.raises(KernelUnavailable, match="not on PATH"):
        get_backend("cpu_fused")


def test_backend_bad_block_id_is_a_value_error(lib: kernels.KernelLibrary) -> None:
    """The trusted hot path (no Python validation) still reports a bad block id or slot as a ValueError."""
    cache, _, q = make_case("fp8_e4m3", "tensor", torch.bfloat16, query_lens=[1, 2], seq_lens=[5, 20])
    backend = FusedCPUBackend()
    bad = AttentionMetadata.build([1, 2], [5, 20], [[cache.shape.num_blocks + 5], [0, 1]], cache.shape.block_size)
    k = torch.zeros(3, cache.shape.num_kv_heads, cache.shape.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block id"):
        backend.lib.attention(q, cache, 1, bad, 0.1)
    with pytest.raises(ValueError, match="slot"):  # the store comes first and finds the slot outside the cache
        backend.forward(q, k, k, cache, 1, bad, 0.1)
