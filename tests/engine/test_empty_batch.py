"""Every step function accepts an empty batch.

A step whose every sampling row failed (non-finite logits, see ``test_engine``) hands the sampler zero rows; a
step may also run layers over zero tokens. Each function below must return an empty result of the right shape
and dtype, never raise, and never read through the (null) data pointer of an empty tensor.
"""

from __future__ import annotations

import pytest
import torch

from kv8.attention.backend import FusedCPUBackend, ReferenceBackend
from kv8.attention.metadata import AttentionMetadata
from kv8.engine.sampler import argmax_reference, compute_logprobs, sample, select_argmax
from kv8.engine.structured import apply_grammar_masks
from kv8.kernels.cpu.build import KernelUnavailable
from kv8.kernels.cpu.dense import DenseKernels, load_dense_kernels
from tests.helpers.kernels import make_case

VOCAB = 400


@pytest.fixture(scope="module")
def dense() -> DenseKernels:
    try:
        return load_dense_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"dense kernels unavailable: {exc}")


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_sampler_and_logprobs(kernel: bool) -> None:
    argmax = select_argmax() if kernel else argmax_reference
    if kernel and argmax is argmax_reference:
        pytest.skip("kv8's argmax kernel is unavailable here")
    empty = torch.empty(0, VOCAB)
    assert argmax(empty).shape == (0,) and argmax(empty).dtype == torch.int64
    for checked in (False, True):
        out = sample(empty, [], [], None, finite_checked=checked, argmax=argmax)
        assert out.token_ids.shape == (0,) and out.logprobs is None and out.top_logprobs is None
    lp, top_v, top_i = compute_logprobs(empty, torch.empty(0, dtype=torch.int64), 5)
    assert lp.shape == (0,) and top_v.shape == (0, 5) and top_i.shape == (0, 5)
    apply_grammar_masks(empty, [])   # no rows, no matchers: nothing to mask


def test_dense_kernels(dense: DenseKernels) -> None:
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    weight = torch.randn(48, 64).to(torch.bfloat16)
    assert dense.linear(x, dense.pack(weight), 48, None).shape == (0, 48)
    codes = torch.randint(0, 126, (48, 64), dtype=torch.uint8)
    assert dense.linear(x, dense.pack_fp8(codes), 48, None, scale=torch.ones(64)).shape == (0, 48)
    norm_w = torch.ones(64, dtype=torch.bfloat16)
    for residual in (None, x):
        out, h = dense.rmsnorm(x, residual, norm_w, 1e-6)
        assert out.shape == (0, 64) and h.shape == (0, 64)
    assert dense.silu_mul(x).shape == (0, 32)
    qkv = torch.empty(0, (4 + 2 * 2) * 8, dtype=torch.bfloat16)
    q, k, v = dense.rope_qkv(qkv, torch.empty(0, 4), torch.empty(0, 4), 4, 2, 8)
    assert q.shape == (0, 4, 8) and k.shape == (0, 2, 8) and v.shape == (0, 2, 8)
    assert dense.argmax(torch.empty(0, VOCAB)).shape == (0,)


@pytest.mark.parametrize("kv_name", ["fp8_e4m3", "bfloat16"])
def test_attention_backends(kv_name: str) -> None:
    cache, _, _ = make_case(kv_name, "tensor", torch.bfloat16)
    meta = AttentionMetadata.build([], [], [], cache.shape.block_size)
    backends: list = [ReferenceBackend()]
    try:
        backends.append(FusedCPUBackend())
    except KernelUnavailable:
        pass
    q = torch.empty(0, 6, 64, dtype=torch.bfloat16)
    kv = torch.empty(0, 2, 64, dtype=torch.bfloat16)
    for backend in backends:
        out = backend.forward(q, kv, kv, cache, 1, meta, 0.125)
        assert out.shape == (0, 6, 64), backend.name
