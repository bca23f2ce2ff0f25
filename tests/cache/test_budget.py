"""kv8.cache.budget: bytes per token and block for every storage, blocks for a budget, the errors naming the option
that set it, and the engine's sizes coming from it."""

from __future__ import annotations

import pytest
import torch

import kv8.cache.budget as budget_module
from kv8.cache.budget import (
    DEFAULT_MAX_MODEL_LEN,
    NO_RESERVE,
    DeviceReserve,
    KVBudget,
    blocks_to_hold,
    default_kv_cache_memory,
    default_max_model_len,
)
from kv8.cache.config import CacheConfig
from kv8.cache.plan import KVPlan, KVSpec
from kv8.platform import CPU, Platform
from kv8.quant.formats import resolve_kv_cache_dtype
from tests.helpers.engine import make_llm

BF16 = resolve_kv_cache_dtype("auto", torch.bfloat16)
GEMMA_270M_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]


def _cache(kv: str = "fp8", **kw) -> CacheConfig:
    return CacheConfig(kv_dtype=resolve_kv_cache_dtype(kv, torch.bfloat16), kv_cache_dtype=kv, **kw)


def _budget(cache: CacheConfig, windows=(None,) * 4, *, head_dim=64, kv_heads=2, max_model_len=256,
            max_num_batched_tokens=2048, skipped=(), plan=None, platform=CPU, reserve=NO_RESERVE) -> KVBudget:
    if skipped:   # what EngineConfig.kv_plan makes of kv_cache_dtype_skip_layers
        plan = KVPlan.build(cache.default_spec, len(windows), {i: KVSpec(BF16) for i, s in enumerate(skipped) if s})
    return KVBudget.build(cache, list(windows), head_dim=head_dim, kv_heads=kv_heads, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, plan=plan, platform=platform,
                          reserve=reserve)


@pytest.mark.parametrize("kv,per_value", [("bfloat16", 2), ("float32", 4), ("fp8_e4m3", 1), ("fp8_e5m2", 1),
                                          ("fp8_e4m3fnuz", 1)])
def test_token_and_block_bytes_per_storage(kv: str, per_value: int) -> None:
    b = _budget(_cache(kv, block_size=16))
    assert b.token_bytes == (2 * 2 * 64 * per_value,)        # K and V, 2 KV heads of 64 values
    assert b.bytes_per_token == 4 * 2 * 2 * 64 * per_value   # 4 layers
    assert b.block_bytes == (4 * 16 * 2 * 2 * 64 * per_value,)


def test_dynamic_scales_add_one_float32_per_token_head_and_kv() -> None:
    b = _budget(_cache("fp8", kv_cache_scale_mode="dynamic"), head_dim=16)
    assert b.token_bytes == (2 * 2 * (16 + 4),)


def test_skipped_layers_form_a_compute_dtype_pool_and_share_the_budget_by_need() -> None:
    b = _budget(_cache("fp8", kv_cache_memory=1 << 20, kv_cache_dtype_skip_layers=(0,)),
                skipped=(True, False, False, False))
    assert [p.spec for p in b.layout.pools] == [0, 1] and b.plan.specs[1] == KVSpec(BF16)
    assert b.token_bytes == (2 * 2 * 64, 2 * 2 * 64 * 2)      # FP8 pool first, then bf16
    assert b.bytes_per_token == 3 * 256 + 512
    blocks = b.num_blocks()
    need = [n * bb for n, bb in zip(b.blocks_per_sequence(), b.block_bytes)]
    # each pool's share of the memory is its share of one max_model_len sequence
    for p in range(2):
        assert blocks[p] == int((1 << 20) * need[p] / sum(need)) // b.block_bytes[p]
    assert sum(n * bb for n, bb in zip(blocks, b.block_bytes)) <= 1 << 20


def test_sliding_window_groups_count_their_window_only() -> None:
    full = _budget(_cache("fp8", disable_hybrid_kv_cache_manager=True), GEMMA_270M_WINDOWS, max_model_len=8192,
                   max_num_batched_tokens=1)
    freed = _budget(_cache("fp8"), GEMMA_270M_WINDOWS, max_model_len=8192, max_num_batched_tokens=1)
    assert full.blocks_per_sequence() == [6 * 512]
    assert freed.blocks_per_sequence() == [512 + 5 * 33]
    # the chunk a prefill step stores widens what a sliding group holds
    chunked = _budget(_cache("fp8"), GEMMA_270M_WINDOWS, max_model_len=8192, max_num_batched_tokens=2048)
    assert chunked.chunk == 2048 and chunked.blocks_per_sequence() == [512 + 5 * (-(-(511 + 2048) // 16) + 1)]


def test_num_blocks_from_memory_and_from_blocks() -> None:
    assert _budget(_cache("fp8", kv_cache_memory=1 << 20)).num_blocks() == [(1 << 20) // (4 * 16 * 256)]
    assert _budget(_cache("fp8", num_kv_blocks=64)).num_blocks() == [64]


def test_too_small_a_budget_names_the_option_that_set_it() -> None:
    with pytest.raises(ValueError, match=r"num_kv_blocks=3 \(--num-kv-blocks\).*raise num_kv_blocks to at least 16"):
        _budget(_cache("fp8", num_kv_blocks=3)).num_blocks()
    with pytest.raises(ValueError, match=r"kv_cache_memory=64.00 KiB \(--kv-cache-memory\).*fewer than max_model_len"
                                         r"=256 needs \(16 blocks"):
        _budget(_cache("fp8", kv_cache_memory=64 * 1024)).num_blocks()
    with pytest.raises(ValueError, match="num_kv_blocks cannot size a cache with layers in 2 pools"):
        _budget(_cache("fp8", num_kv_blocks=64, kv_cache_dtype_skip_layers=(0,)),
                skipped=(True, False, False, False)).num_blocks()


def test_a_cache_beyond_free_memory_is_refused_before_it_is_allocated() -> None:
    b = _budget(_cache("fp8", kv_cache_memory=1 << 50))
    with pytest.raises(ValueError, match=r"kv_cache_memory=1024.00 TiB \(--kv-cache-memory\) asks for a KV cache of "
                                         r".* is free on this machine"):
        b.check_fits_memory(b.num_blocks())
    b.check_fits_memory([1])   # one block fits


def test_defaults() -> None:
    assert default_max_model_len(131072) == DEFAULT_MAX_MODEL_LEN == 8192
    assert default_max_model_len(2048) == 2048
    assert 0 < default_kv_cache_memory() <= 4 * 1024**3
    assert _budget(_cache("fp8")).memory() == default_kv_cache_memory()


def test_blocks_to_hold_counts_sliding_groups_at_full_length() -> None:
    assert blocks_to_hold(GEMMA_270M_WINDOWS, 100, 16, 3) == 6 * 7 * 3


def test_the_engine_sizes_its_cache_with_its_budget(tiny_llama: str) -> None:
    llm = make_llm(tiny_llama, kv_cache_dtype="fp8", kv_cache_memory="1MiB")
    budget = llm.engine.config.kv_budget()
    assert llm.engine.kv_manager.num_blocks == budget.num_blocks()[0]
    assert llm.engine.cache.nbytes == budget.num_blocks()[0] * budget.block_bytes[0]
    assert llm.engine.layout == budget.layout


# ---- on a GPU: gpu_memory_utilization (the device's memory query faked) ------------------------------------------
GiB = 1024**3
H100 = Platform.cuda((9, 0), "NVIDIA H100 80GB HBM3", total_memory=80 * GiB)


@pytest.fixture
def gpu_80g(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 80 GiB GPU with 10 GiB in use before the engine loads (its CUDA context, another process)."""
    monkeypatch.setattr(Platform, "gpu_memory_info", lambda self: (70 * GiB, 80 * GiB))


def test_gpu_budget_is_the_utilization_of_total_less_what_is_in_use_and_the_reserve(gpu_80g) -> None:
    reserve = DeviceReserve(weights=16 * GiB, activations=GiB)
    b = _budget(_cache("fp8"), platform=H100, reserve=reserve)
    assert b.memory() == int(0.9 * 80 * GiB) - 10 * GiB - 17 * GiB          # the default, 0.9
    assert b.num_blocks() == [b.memory() // b.block_bytes[0]]
    half = _budget(_cache("fp8", gpu_memory_utilization=0.5), platform=H100, reserve=reserve)
    assert half.memory() == 40 * GiB - 10 * GiB - 17 * GiB
    assert budget_module.gpu_kv_cache_memory(H100, 1.0, NO_RESERVE) == 70 * GiB   # all that is free
    # kv_cache_memory overrides it; the CPU keeps its own default whatever the utilization
    assert _budget(_cache("fp8", kv_cache_memory=GiB), platform=H100, reserve=reserve).memory() == GiB
    assert _budget(_cache("fp8", gpu_memory_utilization=0.1)).memory() == default_kv_cache_memory()


def test_a_gpu_with_nothing_left_for_the_cache_names_each_part(gpu_80g) -> None:
    b = _budget(_cache("fp8", gpu_memory_utilization=0.3), platform=H100, reserve=DeviceReserve(16 * GiB, GiB))
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization=0.3 lets the engine use 24.00 GiB of the GPU's "
                                         r"80.00 GiB, but 10.00 GiB is in use already, the weights take 16.00 GiB and "
                                         r"the activations 1.00 GiB: nothing is left for the KV cache; raise "
                                         r"gpu_memory_utilization"):
        b.num_blocks()


def test_a_gpu_budget_too_small_for_max_model_len_names_gpu_memory_utilization(gpu_80g) -> None:
    # 24 GiB allowed, 10 in use, 14 GiB - 64 KiB reserved: 64 KiB left, 16 blocks of 16 KiB needed
    b = _budget(_cache("fp8", gpu_memory_utilization=0.3), platform=H100,
                reserve=DeviceReserve(14 * GiB - 64 * 1024, 0))
    assert b.memory() == 64 * 1024
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.3 \(--gpu-memory-utilization: 64.00 KiB for the "
                                         r"KV cache\) has 4 blocks .*raise gpu_memory_utilization or set "
                                         r"kv_cache_memory \(the cache needs at least 256.00 KiB\)"):
        b.num_blocks()


def test_a_gpu_cache_is_checked_against_the_memory_free_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Platform, "gpu_memory_info", lambda self: (GiB, 80 * GiB))
    b = _budget(_cache("fp8", kv_cache_memory=2 * GiB), platform=H100)
    with pytest.raises(ValueError, match=r"asks for a KV cache of 2.00 GiB, but only 1.00 GiB of memory is free on "
                                         r"the cuda device"):
        b.check_fits_memory(b.num_blocks())


@pytest.mark.parametrize("value,message", [
    (0, "gpu_memory_utilization=0 must be a finite number in \\(0, 1\\]"),
    (1.5, "gpu_memory_utilization=1.5 must be a finite number in \\(0, 1\\]"),
    (float("nan"), "gpu_memory_utilization=nan must be a finite number"),
    ("0.9", "gpu_memory_utilization='0.9' must be a finite number"),
    (True, "gpu_memory_utilization=True must be a finite number"),
])
def test_gpu_memory_utilization_is_a_fraction_in_0_1(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        _cache("fp8", gpu_memory_utilization=value)
    assert _cache("fp8", gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_a_plan_of_four_specs_sums_its_layers_and_splits_the_budget_by_need() -> None:
    """Six layers, two of them sliding (window 32): bf16, int4 + Hadamard, FP8 dynamic and the cache's FP8 --
    a pool per spec; bytes per token summed over the layers; blocks per pool in proportion to one sequence's need."""
    def spec(kv: str, rotation: str = "none", mode: str = "static") -> KVSpec:
        return KVSpec.of(resolve_kv_cache_dtype(kv, torch.bfloat16), rotation, mode)

    cache = _cache("fp8", kv_cache_memory=4 << 20)
    windows = (None, 32, None, None, 32, None)
    overrides = {0: spec("bfloat16"), 1: spec("int4", "hadamard"), 3: spec("int4", "hadamard"),
                 4: spec("fp8_e5m2", mode="dynamic")}
    plan = KVPlan.build(cache.default_spec, 6, overrides)
    assert plan.layer_spec == (1, 2, 0, 2, 3, 0) and plan.specs[0] == spec("fp8")
    b = _budget(cache, windows, plan=plan, head_dim=64, kv_heads=2, max_num_batched_tokens=16)
    assert [(p.spec, p.layers) for p in b.layout.pools] == [(0, (2, 5)), (1, (0,)), (2, (1, 3)), (3, (4,))]
    per_head = [64, 128, 32 + 4, 64 + 4]              # fp8, bf16, int4 + scale, fp8 dynamic + scale
    assert b.token_bytes == tuple(2 * 2 * h for h in per_head)
    assert b.bytes_per_token == 4 * (2 * 64 + 128 + 2 * 36 + 68)
    assert b.block_bytes == tuple(n * 16 * t for n, t in zip((2, 1, 1, 1), b.token_bytes))   # pool 2: groups of 1
    # one sequence of 256 tokens: 16 blocks of each full-attention group; a sliding one at most ceil(47 / 16) + 1
    assert b.blocks_per_sequence() == [16, 16, 16 + 4, 4]
    blocks = b.num_blocks()
    need = [n * bb for n, bb in zip(b.blocks_per_sequence(), b.block_bytes)]
    for p in range(4):
        assert blocks[p] == int((4 << 20) * need[p] / sum(need)) // b.block_bytes[p]
    assert len({blocks[p] // b.blocks_per_sequence()[p] for p in range(4)}) <= 2   # all run out together
    assert b.pool_rows()[2] == ("int4_per_token_head + hadamard", (1, 3), 2 * b.token_bytes[2])
    assert [r[0] for r in b.pool_rows()] == ["fp8_e4m3", "bfloat16", "int4_per_token_head + hadamard",
                                             "fp8_e5m2, dynamic scales"]
    with pytest.raises(ValueError, match=r"each in fp8_e4m3\), fewer than max_model_len=256 needs \(80 blocks"):
        _budget(_cache("fp8", kv_cache_memory=64 << 10), windows, plan=KVPlan.build(
            cache.default_spec, 6, {1: spec("int4", "hadamard")})).num_blocks()
    with pytest.raises(ValueError, match="num_kv_blocks cannot size a cache with layers in 4 pools"):
        _budget(_cache("fp8", num_kv_blocks=64), windows, plan=plan).num_blocks()
    with pytest.raises(ValueError, match="a KV plan of 6 layers for a model of 4"):
        _budget(cache, plan=plan)
