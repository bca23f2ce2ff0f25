"""``benchmarks/bench_attention.py``'s caches for ``--layers N``: ``prefill_cache`` stores layers 0 and 1 through the
codec and makes every later layer a copy of one of them (distinct buffers, the same bytes), so N layers cost two
layers' encoding and each call reads its own cache; the attention of a copy equals its original's (a K/V pair's, k8v4,
too: its keys and values each in their own format)."""

from __future__ import annotations

import sys

import pytest
import torch

from kv8.attention.reference import paged_attention_reference
from tests.helpers.paths import ROOT, load_file_module

sys.path.insert(0, str(ROOT / "benchmarks"))   # its sibling module `revisions`
bench = load_file_module(ROOT / "benchmarks" / "bench_attention.py")


@pytest.mark.parametrize("kv_name,dynamic", [("int4_per_token_head", True), ("fp8_e4m3", False), ("bfloat16", False),
                                             ("k8v4", True)])
def test_layers_past_two_are_copies_of_the_first_two(kv_name: str, dynamic: bool) -> None:
    cache, meta = bench.prefill_cache(kv_name, 5, 2, 1, 40, dynamic)
    assert cache.shape.num_layers == 5
    assert not torch.equal(cache.k_data[0], cache.k_data[1])
    for t in cache.tensors:
        for layer in range(2, 5):
            assert t[layer].data_ptr() != t[layer % 2].data_ptr()
            assert torch.equal(t[layer], t[layer % 2])
    q = torch.randn(2, bench.HQ, bench.D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    scale = bench.D ** -0.5
    assert torch.equal(paged_attention_reference(q, cache, 3, meta, scale),
                       paged_attention_reference(q, cache, 1, meta, scale))
