"""The engine end to end on the GPU path's attention backend (``attention_backend="triton"``), run here on CPU tensors
in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` without a GPU): greedy tokens equal to
the reference backend's (both read the same stored bytes), with every block returned, over FP8 formats, scale modes,
int8, int4, int4_per_group32 and fp4_e2m1 caches, a rotation, GQA, sliding windows and the hybrid layout, prefix
caching, chunked prefill and preemption; and decode steps served from the CUDA-graph buffers
(:class:`kv8.engine.cuda_graphs.DecodeGraphs` without capture) equal to eager steps."""

from __future__ import annotations

import pytest

from kv8 import LLM, SamplingParams
from kv8.engine.cuda_graphs import decode_buckets
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = ["The quick brown fox jumps over", "Paris is the capital of France, and Berlin is",
           "Paris is the capital of France, and Berlin is the capital of", "Once upon"]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _run(path: str, backend: str, **kw) -> tuple[list[list[int]], LLM]:
    if "num_kv_blocks" not in kw:
        kw.setdefault("kv_cache_memory", "4MiB")
    kw.setdefault("max_model_len", 128)
    llm = LLM(model=path, dtype="float32", attention_backend=backend, **kw)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    kv = llm.engine.kv_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, "blocks were not returned"
    return tokens, llm


CASES = [
    ("llama_gqa", dict(kv_cache_dtype="fp8_e4m3")),
    ("llama_gqa", dict(kv_cache_dtype="fp8_e5m2", kv_cache_scale_mode="dynamic")),
    ("llama_gqa", dict(kv_cache_dtype="fp8_e4m3fnuz", kv_cache_rotation="hadamard")),
    ("llama_gqa", dict(kv_cache_dtype="bfloat16")),
    ("llama_gqa", dict(kv_cache_dtype="int8")),
    # chunked prefill (chunks of 8 tokens over the cached ones) and preemption (7 blocks of 4 tokens for 4
    # sequences of up to 21)
    ("llama", dict(kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=8, num_kv_blocks=7, block_size=4,
                   max_model_len=24)),
    ("mistral_swa", dict(kv_cache_dtype="fp8_e4m3")),
    ("mistral_swa", dict(kv_cache_dtype="int8_per_token_head", kv_cache_rotation="hadamard")),
    ("llama_gqa", dict(kv_cache_dtype="int4")),
    ("mistral_swa", dict(kv_cache_dtype="int4_per_token_head", kv_cache_rotation="hadamard")),
    ("qwen3", dict(kv_cache_dtype="int4_per_group32")),                  # head_dim 32: one group per row
    ("llama_gqa", dict(kv_cache_dtype="fp4_e2m1")),                      # head_dim 16: one E4M3 scale per row
    ("qwen3", dict(kv_cache_dtype="fp4_e2m1", kv_cache_rotation="hadamard")),   # two groups per row
    ("mistral_swa", dict(kv_cache_dtype="fp4_e2m1")),
    ("llama", dict(kv_cache_dtype="fp4_e2m1", max_num_batched_tokens=8, num_kv_blocks=7, block_size=4,
                   max_model_len=24)),                                   # chunked prefill and preemption
    ("gemma3", dict(kv_cache_dtype="fp8_e4m3", kv_cache_dtype_skip_layers="full_attention")),
]


@pytest.mark.parametrize(("model", "options"), CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{v}" for v in c.values()))
def test_triton_backend_matches_the_reference(tiny_models, model, options):
    expected, _ = _run(tiny_models[model], "reference", **options)
    got, llm = _run(tiny_models[model], "triton", **options)
    assert llm.engine.backend.name == "triton"
    assert got == expected
    if "num_kv_blocks" in options:
        assert llm.engine.stats().num_preemptions > 0


def test_k8v4_pair_matches_the_reference(tmp_path):
    """Keys and values in different formats (``kv_cache_dtype="k8v4"``: int8 K with its per-token scales,
    int4_per_group32 V) on a tiny random llama with head_dim 32 (V's groups of 32; GQA 3): the triton backend stores
    and reads each side in its own format, and its greedy tokens equal the reference backend's."""
    path = make_tiny_model(str(tmp_path), "llama_gqa", head_dim=32)
    expected, _ = _run(path, "reference", kv_cache_dtype="k8v4")
    got, llm = _run(path, "triton", kv_cache_dtype="k8v4")
    assert llm.engine.backend.name == "triton"
    cache = llm.engine.cache
    assert (cache.k_dtype.name, cache.v_dtype.name) == ("int8_per_token_head", "int4_per_group32")
    assert got == expected


def test_decode_graph_buffers_match_eager_steps(tiny_models):
    """The static-buffer path of CUDA graphs (padded to a bucket, slots -1, tables padded with 0), run eagerly
    here: the same tokens as eager steps, most decode steps served from it."""
    path = tiny_models["mistral_swa"]   # two KV cache groups' buffers: full attention and the window
    eager, _ = _run(path, "triton", kv_cache_dtype="fp8_e4m3")
    llm = LLM(model=path, dtype="float32", attention_backend="triton", max_model_len=128, kv_cache_memory="4MiB",
              kv_cache_dtype="fp8_e4m3", max_num_seqs=6)
    runner = llm.engine.runner
    runner.enable_decode_graphs(max_num_seqs=6, max_model_len=128, capture=False)
    assert tuple(runner.graphs.buckets) == decode_buckets(6) == (1, 2, 4, 6)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == eager
    assert runner.graphs.replays >= PARAMS.max_tokens - 2   # every pure decode step of the batch
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_decode_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
