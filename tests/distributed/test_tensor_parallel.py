"""Tensor parallelism (kv8.distributed): sharded layers against whole ones, config errors, per-rank scales, and
engines of 2 and 3 ranks (spawned processes, gloo on 127.0.0.1) against one rank; dead ranks and shutdown.

Each engine test starts real worker processes (a few seconds each on a busy machine), with one torch thread per
rank; the heavier cases are marked slow.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kv8 import LLM, SamplingParams
from kv8.cache.config import CacheConfig
from kv8.cache.scale_sources import engine_kv_scales
from kv8.distributed.config import ParallelConfig
from kv8.distributed.group import TensorParallelError, TPGroup
from kv8.distributed.shard import building_shard, kv_head_shard, local_head_counts
from kv8.engine.worker import WORKER_MODULE
from kv8.layers.dense_backend import TORCH_BACKEND
from kv8.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from kv8.models.registry import arch_config
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.scale_files import write_kv8_scales_json
from kv8.quant.scales import KVScales, ModelScaleInfo, ScaleGranularity
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = ["hello world how are you", "the cat sat on the mat and"]


# ---- sharding without processes -------------------------------------------------------------------------------
def test_kv_head_shards_split_or_replicate() -> None:
    # 8 q / 2 KV heads over 4 ranks: KV head r // 2, as in vLLM; each rank's q heads use its KV head
    assert [kv_head_shard(2, TPGroup(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_shard(3, TPGroup(r, 3)) for r in range(3)] == [(0, 1), (1, 1), (2, 1)]
    assert [kv_head_shard(4, TPGroup(r, 2)) for r in range(2)] == [(0, 2), (2, 2)]
    assert local_head_counts(8, 2, TPGroup(3, 4)) == (2, 1)


@pytest.mark.parametrize("tp_size, hq, hkv", [(2, 6, 2), (3, 6, 3), (4, 8, 2)])
def test_sharded_linears_reassemble_the_whole(tp_size: int, hq: int, hkv: int) -> None:
    """Each rank's column-parallel output is its slice of the whole; row-parallel partial outputs sum to the
    whole; biases of row-parallel layers count once."""
    torch.manual_seed(0)
    e, d, inter = 24, 4, 12
    w_q, w_k, w_v = torch.randn(hq * d, e), torch.randn(hkv * d, e), torch.randn(hkv * d, e)
    b_q, b_k, b_v = torch.randn(hq * d), torch.randn(hkv * d), torch.randn(hkv * d)
    w_gate, w_up, w_down, b_o = torch.randn(inter, e), torch.randn(inter, e), torch.randn(e, inter), torch.randn(e)
    x, h = torch.randn(5, e), torch.randn(5, inter)
    whole_q, whole_k = x @ w_q.T + b_q, x @ w_k.T + b_k
    down_sum = torch.zeros(5, e)
    for r in range(tp_size):
        with building_shard(TPGroup(r, tp_size)):
            qkv = QKVLinear(e, d, hq, hkv, True, TORCH_BACKEND)
            gate_up = MergedLinear(e, [inter, inter], False, TORCH_BACKEND)
            down = RowParallelLinear(inter, e, True, TORCH_BACKEND)
        for shard, w, b in (("q", w_q, b_q), ("k", w_k, b_k), ("v", w_v, b_v)):
            qkv.weight_loader(qkv.weight, w, shard)
            assert qkv.bias is not None
            qkv.weight_loader(qkv.bias, b, shard)
        gate_up.weight_loader(gate_up.weight, w_gate, 0)
        gate_up.weight_loader(gate_up.weight, w_up, 1)
        down.weight_loader(down.weight, w_down)
        assert down.bias is not None
        down.weight_loader(down.bias, b_o)
        lq, lkv = qkv.num_heads, qkv.num_kv_heads
        q, k, _ = qkv(x).split([lq * d, lkv * d, lkv * d], dim=-1)
        torch.testing.assert_close(q, whole_q[:, r * lq * d:(r + 1) * lq * d])
        k0 = qkv.kv_head_start
        torch.testing.assert_close(k, whole_k[:, k0 * d:(k0 + lkv) * d])
        n = inter // tp_size
        torch.testing.assert_close(gate_up(x), torch.cat([x @ w_gate[r * n:(r + 1) * n].T,
                                                          x @ w_up[r * n:(r + 1) * n].T], dim=-1))
        down_sum += down.method.apply(down, h[:, r * n:(r + 1) * n])   # the all-reduce's input
    torch.testing.assert_close(down_sum, h @ w_down.T + b_o)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_vocab_parallel_layers_reassemble_the_whole(tp_size: int) -> None:
    """Each rank holds ceil(V / N) rows (zeros past V); the ranks' embedding rows sum to the lookup and their
    logits, side by side, are the whole LM head's (what rank 0's gather concatenates)."""
    from kv8.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

    torch.manual_seed(0)
    vocab, e = 385, 16                                      # not a multiple of 2 or 3: the last rank pads
    table, x = torch.randn(vocab, e), torch.randn(4, e)
    ids = torch.tensor([0, 1, 128, 129, 192, 193, 257, 384])
    emb_sum, parts = torch.zeros(len(ids), e), []
    for r in range(tp_size):
        tp = TPGroup(r, tp_size)
        tp.all_reduce = lambda t: t                         # type: ignore[method-assign]  # summed below
        with building_shard(tp):
            emb, head = VocabParallelEmbedding(vocab, e), ParallelLMHead(e, vocab, TORCH_BACKEND)
        emb.weight_loader(emb.weight, table)
        head.weight_loader(head.weight, table)
        assert emb.weight.shape == head.weight.shape == (-(-vocab // tp_size), e)
        emb_sum += emb(ids)
        parts.append(head.method.apply(head, x))
    assert torch.equal(emb_sum, table[ids])
    logits = torch.cat(parts, dim=-1)
    torch.testing.assert_close(logits[:, :vocab], x @ table.T)
    assert not logits[:, vocab:].any()
    with pytest.raises(ValueError, match=r"has shape \(384, 16\), the model expects \(385, 16\)"):
        emb.weight_loader(emb.weight, table[:384])


def test_parallel_config_errors_name_the_sizes() -> None:

    cfg = dict(model_type="llama", vocab_size=10, hidden_size=96, intermediate_size=192, num_hidden_layers=1,
               num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    arch6 = arch_config(cfg)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the model's num_attention_heads=6"):
        ParallelConfig(4).check_model(arch6)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's num_key_value_heads=2, "
                                         r"or be a multiple of it"):
        ParallelConfig(3).check_model(arch6)
    with pytest.raises(ValueError, match=r"must divide the model's intermediate_size=191"):
        ParallelConfig(2).check_model(arch_config({**cfg, "intermediate_size": 191}))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be an int >= 1"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match=r"cpu_threads_per_rank=0 must be an int >= 1"):
        ParallelConfig(2, 0)
    ParallelConfig(2).check_model(arch6)   # 3 q heads and 1 KV head per rank
    assert ParallelConfig(2).kv_heads_per_rank(arch6) == 1
    assert ParallelConfig(4, None).threads(16) == 4 and ParallelConfig(1).threads(16) is None


def test_vllm_scales_per_rank_and_head_slices(tmp_path: Path) -> None:
    """scaling_factor[tp_rank] goes to its rank; kv8 per-head scales are cut to the rank's KV heads."""
    model = ModelScaleInfo("llama", 2, 4, 8)
    path = tmp_path / "kv_cache_scales.json"
    path.write_text(json.dumps({"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {"0": 0.5, "1": 0.25}, "1": {"0": 2.0, "1": 4.0}}}}))
    cache = CacheConfig(kv_dtype=resolve_kv_cache_dtype("fp8", torch.bfloat16), quantization_param_path=str(path))
    for rank, expected in ((0, [0.5, 0.25]), (1, [2.0, 4.0])):
        scales = engine_kv_scales(cache, model, {}, {}, rank, 2, (2 * rank, 2))
        assert scales is not None and scales.k.flatten().tolist() == expected
    with pytest.raises(ValueError, match="2 TP rank"):
        engine_kv_scales(cache, model, {}, {}, 0, 1)
    per_head = {f"model.layers.{i}.self_attn.{r}_scale": torch.tensor([1.0, 2.0, 3.0, 4.0]) * (i + 1)
                for i in range(2) for r in "kv"}
    plain = CacheConfig(kv_dtype=resolve_kv_cache_dtype("fp8", torch.bfloat16))
    scales = engine_kv_scales(plain, model, per_head, {}, 1, 2, (2, 2))
    assert scales is not None and scales.k[:, :, 0].tolist() == [[3.0, 4.0], [6.0, 8.0]]


# ---- engines over several processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gqa_6x2(tmp_path_factory) -> str:
    """6 query heads, 2 KV heads (qwen2: q/k/v biases): TP=2 splits the KV heads, TP=3 cannot."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tp6x2")), "qwen2", num_attention_heads=6,
                           num_key_value_heads=2)


@pytest.fixture(scope="module")
def gqa_6x2_d32(tmp_path_factory) -> str:
    """gqa_6x2 at head_dim 32 (int4_per_group32 stores whole groups of 32 values)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tp6x2d32")), "qwen2", num_attention_heads=6,
                           num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def gqa_6x3(tmp_path_factory) -> str:
    """6 query heads, 3 KV heads (llama): TP=3 gives each rank one KV head."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tp6x3")), "llama_gqa", num_key_value_heads=3)


def _llm(path: str, tp: int, kv: str = "auto", **kw) -> LLM:
    kw.setdefault("kv_cache_memory", None if "num_kv_blocks" in kw else "2MiB")
    kw.setdefault("max_model_len", 256)
    return LLM(path, dtype="float32", kv_cache_dtype=kv, tensor_parallel_size=tp, cpu_threads_per_rank=1, **kw)


def _run(llm: LLM) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens and prompt-token logprobs of PROMPTS, then the greedy tokens of a prompt that extends the
    first one (its blocks come from the prefix cache)."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0))
    again = llm.generate(PROMPTS[0] + " again and again", SamplingParams(temperature=0, max_tokens=6))
    tokens = [list(o.outputs[0].token_ids) for o in outs + again]
    lps = [pos[tid].logprob for o in outs if o.prompt_logprobs
           for tid, pos in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]) if pos is not None]
    return tokens, lps   # the prompt tokens' logprobs of every prompt, one after the other


def _compare(path: str, tp: int, kv: str, **kw) -> None:
    one = _llm(path, 1, kv, **kw)
    ref_tokens, ref_lps = _run(one)
    many = _llm(path, tp, kv, **kw)
    procs = list(many.engine.tp.procs)
    assert len(procs) == tp - 1 and all(p.is_alive() for p in procs)
    assert many.engine.tp.shm is not None   # ranks kv8 started sum through shared memory (torchrun's use gloo)
    vocab = one.engine.model.model.embed_tokens.weight.shape[0]   # each rank holds its share of the vocabulary
    assert many.engine.model.model.embed_tokens.weight.shape[0] == -(-vocab // tp)
    # the rank's cache holds its KV heads: the same budget gives more blocks per rank
    assert many.engine.cache.shape.num_kv_heads == max(1, one.engine.cache.shape.num_kv_heads // tp)
    tokens, lps = _run(many)
    assert tokens == ref_tokens
    if many.engine.config.cache.block_size <= 4:
        assert many.engine.stats().prefix_cache_hit_rate > 0
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-4, rtol=1e-4)
    del many
    gc.collect()   # the engine's finalizer stops its ranks
    for p in procs:
        p.join(10)
    assert all(p.exitcode is not None for p in procs), "a rank outlived its engine"


def test_tp2_equals_tp1_float32(gqa_6x2: str) -> None:
    """Also with chunked prefill (8 tokens a step) and prefix-cache hits (blocks of 4 tokens)."""
    _compare(gqa_6x2, 2, "auto", max_num_batched_tokens=8, block_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_tp2_equals_tp1_fp8(gqa_6x2: str, kv: str) -> None:
    _compare(gqa_6x2, 2, kv)


def test_tp2_equals_tp1_fp4(gqa_6x2: str) -> None:
    """fp4_e2m1: each rank's rows carry their own group scales; with chunked prefill and prefix-cache hits."""
    _compare(gqa_6x2, 2, "fp4_e2m1", max_num_batched_tokens=8, block_size=4)


def test_tp2_equals_tp1_int4_per_group32(gqa_6x2_d32: str) -> None:
    """int4_per_group32 with the rotation: each rank's rows carry their own float16 group scales; with chunked
    prefill and prefix-cache hits."""
    _compare(gqa_6x2_d32, 2, "int4_per_group32", max_num_batched_tokens=8, block_size=4, kv_cache_rotation="hadamard")


def test_tp2_equals_tp1_k8v4(gqa_6x2_d32: str) -> None:
    """Keys and values in their own formats (int8 keys with their per-token scales, int4_per_group32 values with
    their group scales) on each rank's heads; with chunked prefill and prefix-cache hits."""
    _compare(gqa_6x2_d32, 2, "k8v4", max_num_batched_tokens=8, block_size=4, kv_cache_rotation="hadamard")


def test_tp2_equals_tp1_with_a_kv_plan(gqa_6x2: str, tmp_path: Path) -> None:
    """kv_cache_plan: layer 0 int4 + Hadamard, layer 1 the cache's FP8 -- two pools on every rank, each rank
    reading the plan file itself."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {"0": {"kv_cache_dtype": "int4",
                                                                   "kv_cache_rotation": "hadamard"}}}))
    _compare(gqa_6x2, 2, "fp8", kv_cache_plan=str(plan), block_size=4)


def test_tp2_equals_tp1_with_key_centering(gqa_6x2: str, tmp_path: Path) -> None:
    """Key offsets from a kv8 file (int4 + Hadamard: the centered keys are what is quantized), each rank centering
    its own KV heads' keys by their slice of the offsets, which differ per head."""
    from kv8.quant.key_offsets import KeyOffsets

    c = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(0))
    c[:, 1] += 3.0   # the KV heads' offsets differ: a rank reading the other's slice would not match
    path = tmp_path / "centered.json"
    write_kv8_scales_json(path, KVScales.default(2), ModelScaleInfo("qwen2", 2, 2, 16), KeyOffsets(c, "test"))
    _compare(gqa_6x2, 2, "int4", kv_cache_rotation="hadamard", quantization_param_path=str(path), block_size=4)


def test_tp2_equals_tp1_with_key_scaling(gqa_6x2: str, tmp_path: Path) -> None:
    """Key offsets and factors (int4 + Hadamard): each rank scales its KV heads' keys and its query heads by its
    heads' slice of the factors, which differ per head."""
    from kv8.quant.key_offsets import KeyOffsets
    from kv8.quant.key_scaling import KeyScaling

    g = torch.Generator().manual_seed(0)
    c = torch.randn(2, 2, 16, generator=g)
    s = torch.exp(2 * torch.rand(2, 2, 16, generator=g) - 1)
    s[:, 1] *= 3.0   # a rank reading the other's slice would not match
    path = tmp_path / "scaled.json"
    write_kv8_scales_json(path, KVScales.default(2), ModelScaleInfo("qwen2", 2, 2, 16), KeyOffsets(c, "test"),
                          KeyScaling(s, "test"))
    _compare(gqa_6x2, 2, "int4", kv_cache_rotation="hadamard", quantization_param_path=str(path), block_size=4)


@pytest.mark.slow
def test_tp2_equals_tp1_with_fp8_weights(gqa_6x2: str) -> None:
    """quantization="fp8": o_proj and down_proj ranks hold half of each row, quantized with the whole rows'
    scales, so both rank counts multiply by the same weights."""
    _compare(gqa_6x2, 2, "fp8", quantization="fp8")


def _seeded_under_pressure(llm: LLM) -> tuple[list[str], int]:
    """Seeded random sampling of many prompts at once in a cache too small for them (preemption, recompute)."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} number {i}" for i in range(8)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    return [o.outputs[0].text for o in outs], llm.engine.stats().num_preemptions


def test_tp2_seeded_sampling_and_preemption_equal_tp1(gqa_6x2: str) -> None:
    """Per-request seeds give the same texts as one rank, also when the cache is too small for the batch and
    requests are preempted and recomputed (float32: logits agree to ~1e-6, far below what moves a sample)."""
    kw = dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=16, max_model_len=64)
    ref, ref_preempted = _seeded_under_pressure(_llm(gqa_6x2, 1, **kw))
    two = _llm(gqa_6x2, 2, **kw)
    got, preempted = _seeded_under_pressure(two)
    two.close()
    assert ref_preempted > 0 and preempted == ref_preempted
    assert got == ref


@pytest.mark.slow
def test_tp2_gemma3_tied_vocab_parallel_and_sliding_windows(tmp_path: Path) -> None:
    """Gemma 3 (tied embedding and LM head, both vocab-parallel; one KV head replicated on both ranks; sliding-
    window layers whose blocks are freed) equals one rank, in float32 and FP8."""
    path = make_tiny_model(str(tmp_path / "gemma"), "gemma3")
    _compare(path, 2, "auto", block_size=4)
    _compare(path, 2, "fp8")


@pytest.mark.slow
def test_tp3_smollm2_gguf_equals_one_rank() -> None:
    """The real model from its GGUF (Q4_1 dequantized; 9 query / 3 KV heads, tied 49,152-token vocabulary split in
    three) gives one rank's greedy text under TP=3."""
    prompt, params = "The capital of France is", SamplingParams(temperature=0, max_tokens=12)
    kw = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, cpu_threads_per_rank=1)
    one = LLM("smollm2-135m", **kw).generate(prompt, params)[0].outputs[0].text
    three = LLM("smollm2-135m", tensor_parallel_size=3, **kw)
    assert three.generate(prompt, params)[0].outputs[0].text == one
    three.close()


@pytest.mark.slow
def test_tp3_splits_three_kv_heads(gqa_6x3: str) -> None:
    _compare(gqa_6x3, 3, "auto")
    _compare(gqa_6x3, 3, "fp8", kv_cache_scale_mode="dynamic", kv_cache_rotation="hadamard")
    _compare(gqa_6x3, 3, "int8_per_token_head")


@pytest.mark.slow
def test_vllm_scales_reach_their_rank(gqa_6x2: str, tmp_path: Path) -> None:
    """A vLLM file with other scales per rank (TP=2, rank r holds KV head r) stores what one rank stores with
    kv8 per-head scales [rank 0's, rank 1's]; the file with its ranks swapped stores something else."""
    per_rank = {0: [0.004, 0.006], 1: [0.5, 0.3]}      # layer scales of each rank: far apart, both visible

    def vllm_file(name: str, ranks: dict[int, list[float]]) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"model_type": "qwen2", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
            str(r): {str(i): s for i, s in enumerate(layers)} for r, layers in ranks.items()}}}))
        return str(path)

    heads = torch.tensor([[per_rank[0][i], per_rank[1][i]] for i in range(2)]).unsqueeze(-1)   # [L, H=2, 1]
    kv8_file = tmp_path / "kv8.json"
    write_kv8_scales_json(kv8_file, KVScales(heads, heads, ScaleGranularity.HEAD, "test", "fp8_e4m3"),
                          ModelScaleInfo("qwen2", 2, 2, 16))
    ref_tokens, ref_lps = _run(_llm(gqa_6x2, 1, "fp8", quantization_param_path=str(kv8_file)))
    tokens, lps = _run(_llm(gqa_6x2, 2, "fp8", quantization_param_path=vllm_file("v.json", per_rank)))
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-4, rtol=1e-4)
    _, swapped = _run(_llm(gqa_6x2, 2, "fp8", quantization_param_path=vllm_file("s.json", {0: per_rank[1],
                                                                                           1: per_rank[0]})))
    assert (torch.tensor(swapped) - torch.tensor(ref_lps)).abs().max() > 1e-3


@pytest.mark.slow
def test_tp4_replicates_two_kv_heads(tmp_path: Path) -> None:
    """8 query heads, 2 KV heads over 4 ranks: each KV head lives on two ranks (vLLM's replication)."""
    path = make_tiny_model(str(tmp_path), "llama", num_attention_heads=8, num_key_value_heads=2, head_dim=12)
    _compare(path, 4, "fp8")


def test_tp3_with_two_kv_heads_is_refused(gqa_6x2: str) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's num_key_value_heads=2"):
        _llm(gqa_6x2, 3)


def test_killed_rank_fails_the_engine_within_seconds(gqa_6x2: str, caplog: pytest.LogCaptureFixture) -> None:
    llm = _llm(gqa_6x2, 2)
    proc = llm.engine.tp.procs[0]
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    deadline = time.monotonic() + 5   # the idle engine's watcher logs it at once
    while "rank 1 (exit code -9) exited; the engine fails at its next step" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(exit code -9\) exited"):
        llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    assert time.monotonic() - start < 10
    llm.engine.shutdown()
    assert not proc.is_alive()


SCRIPT_WITHOUT_GUARD = """
import sys
from kv8 import LLM, SamplingParams
llm = LLM({model!r}, tensor_parallel_size=2, dtype="float32", kv_cache_memory="2MiB", max_model_len=256,
          cpu_threads_per_rank=1)
print("TEXT=" + repr(llm.generate("hello world", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text))
llm.close()
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_tp2_from_a_script_without_main_guard(gqa_6x2: str, tmp_path: Path, how: str) -> None:
    """A script that builds a tensor-parallel LLM at module level (no ``if __name__ == "__main__":``), run as a
    file or fed on stdin: the ranks start without importing it (a spawn start re-ran it, or looked for
    ``<stdin>``) and the text equals one rank's."""
    single = _llm(gqa_6x2, 1).generate("hello world", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    script = SCRIPT_WITHOUT_GUARD.format(model=gqa_6x2)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if how == "file":
        path = tmp_path / "no_guard.py"
        path.write_text(script)
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300,
                             cwd=tmp_path)
    else:
        run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, env=env,
                             timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"TEXT={single!r}" in run.stdout.splitlines(), run.stdout + run.stderr
    # the rank shares the script's stderr: no runpy warning (issue 42, item 6: it ran a module kv8 imports)
    assert "found in sys.modules" not in run.stderr, run.stderr


def test_the_rank_entry_module_runs_without_runpy_warnings() -> None:
    """``python -m WORKER_MODULE`` (what kv8 starts each rank with) raises no RuntimeWarning, even made an error:
    ``import kv8`` must not import the module the ranks run (it did: kv8.engine.worker)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", WORKER_MODULE, "--help"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: python -m {WORKER_MODULE} [-h] --rank RANK"), run.stdout
    assert run.stderr == ""


class _CutStore:
    """A store shared by a test's ranks; ``cut`` ranks' heartbeats fail, as a dead process's would stop."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.inner = dist.HashStore()
        self.cut: set[int] = set()

    def add(self, key: str, value: int) -> int:
        if value and int(key.rsplit("/", 1)[1]) in self.cut:
            raise RuntimeError("connection reset")
        return int(self.inner.add(key, value))


def test_heartbeats_tell_rank_0_which_torchrun_rank_went_silent() -> None:
    from kv8.distributed.group import TPGroup

    store = _CutStore()
    for rank in (1, 2):
        TPGroup(rank, 3).start_heartbeat(store, period=0.02)
    driver = TPGroup(0, 3)
    reports: list[str] = []
    driver.on_rank_exit.append(reports.append)
    driver.watch_heartbeats(store, period=0.02, dead_after=0.3)
    time.sleep(0.6)
    assert reports == []                              # both beat: nothing to report, however long it waits
    store.cut.add(2)
    deadline = time.monotonic() + 5
    while not reports:
        assert time.monotonic() < deadline, "rank 2's silence was not reported"
        time.sleep(0.02)
    assert len(reports) == 1 and reports[0].startswith("rank 2 (no heartbeat for 0 s) stopped"), reports
    assert driver.dead_ranks().startswith("rank 2 (no heartbeat") and "rank 1" not in driver.dead_ranks()


@pytest.mark.slow
def test_a_torchrun_rank_that_dies_while_the_server_is_idle_takes_it_down(gqa_6x2: str, tmp_path: Path) -> None:
    """``kv8 serve`` over two torchrun "nodes": rank 1 killed while no request runs; rank 0's server notices
    from the heartbeats (no child process to watch), logs the rank and exits with status 1 within seconds."""
    import httpx

    from tests.helpers.server import ENGINE_FLAGS, free_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = s.getsockname()[1]
    http = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(master)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = [open(tmp_path / f"node{r}.log", "wb") for r in (0, 1)]
    procs = [subprocess.Popen([*torchrun, "--node-rank", str(r), "-m", "kv8", "serve", gqa_6x2, *ENGINE_FLAGS,
                               "--tensor-parallel-size", "2", "--cpu-threads-per-rank", "1", "--port", str(http)],
                              stdout=logs[r], stderr=subprocess.STDOUT, env=env, start_new_session=True)
             for r in (0, 1)]

    def log(r: int) -> str:
        return (tmp_path / f"node{r}.log").read_text(errors="replace")

    try:
        deadline = time.monotonic() + 180
        while True:
            assert procs[0].poll() is None, log(0)
            assert time.monotonic() < deadline, log(0)
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        agent = procs[1].pid
        children = subprocess.run(["ps", "--ppid", str(agent), "-o", "pid="], capture_output=True,
                                  text=True).stdout.split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signal.SIGKILL)    # rank 1's worker process, while the server is idle
        start = time.monotonic()
        assert procs[0].wait(timeout=60) == 1, log(0)
        assert time.monotonic() - start < 30
        assert "tensor-parallel rank 1 (no heartbeat for" in log(0), log(0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for f in logs:
            f.close()


@pytest.mark.slow
def test_two_torchrun_nodes_generate_like_one_rank(gqa_6x2: str) -> None:
    """Two torchrun launches (two "nodes" of one process each, one rendezvous on 127.0.0.1) run one request end
    to end: rank 0 prints the text of a single-rank engine, rank 1 exits cleanly when rank 0 stops."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--model", gqa_6x2, "--dtype", "float32", "--kv-cache-memory", "2MiB", "--max-model-len", "256",
             "--max-tokens", "6", "--temperature", "0", "--cpu-threads-per-rank", "1"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([*torchrun, "--node-rank", str(r), "-m", "kv8", "generate", "hello world", *flags,
                               "--tensor-parallel-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    single = subprocess.run([sys.executable, "-m", "kv8", "generate", "hello world", *flags], capture_output=True,
                            text=True, env=env, timeout=300)
    assert single.stdout.strip() and single.stdout.strip().splitlines()[-1] in outs[0]


@pytest.mark.slow
def test_server_under_tp2_serves_then_dies_cleanly_with_a_rank(gqa_6x2: str, tmp_path: Path) -> None:
    """`kv8 serve --tensor-parallel-size 2` answers as one rank does; a killed rank takes the idle server down at
    once, without waiting for a request: it logs the rank and exits with status 1 (a supervisor restarts it)
    leaving no worker behind."""
    import openai

    from tests.helpers.server import ENGINE_FLAGS, Server

    single = _llm(gqa_6x2, 1).generate("hello world", SamplingParams(temperature=0, max_tokens=6))[0]
    srv = Server(["serve", "--model-id", gqa_6x2, *ENGINE_FLAGS, "--tensor-parallel-size", "2",
                  "--cpu-threads-per-rank", "1"], str(tmp_path / "server.log"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60.0)
        text = client.completions.create(model=gqa_6x2, prompt="hello world", max_tokens=6, temperature=0)
        assert text.choices[0].text == single.outputs[0].text
        children = subprocess.run(["ps", "--ppid", str(srv.proc.pid), "-o", "pid=,args=", "-ww"], capture_output=True,
                                  text=True).stdout.splitlines()
        workers = [int(line.split()[0]) for line in children if WORKER_MODULE in line]
        assert len(workers) == 1, children
        os.kill(workers[0], signal.SIGKILL)
        assert srv.proc.wait(timeout=30) == 1, srv.read_log()
        assert "tensor-parallel rank 1 (exit code -9) exited; the engine cannot continue" in srv.read_log()
        assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
    finally:
        srv.stop()
