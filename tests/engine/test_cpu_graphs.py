"""Decode steps of small batches replayed from CPU graphs (kv8.engine.cuda_graphs on the CPU,
kv8.kernels.cpu.graph): on by default on the CPU, off with ``enforce_eager``; the tokens and logprobs equal an
eager engine's for every architecture family the tiny models cover (kernels only, torch norms in Gemma's forward,
sliding-window groups, GQA), with padded batches (3 sequences in the bucket of 4) and a batch above the largest
bucket running eagerly."""

from __future__ import annotations

import logging

import pytest

from kv8 import LLM, SamplingParams
from kv8.engine.cuda_graphs import CPU_GRAPH_MAX_BATCH, DecodeGraphs
from kv8.kernels.cpu.graph import CaptureRefused, CPUGraph

PROMPTS = [[3, 9, 27, 81, 5], [7, 1], [11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53], [2] * 20]


def _run(model: str, prompts: list[list[int]], **options) -> tuple[list, LLM]:
    llm = LLM(model=model, max_model_len=128, kv_cache_memory="8MiB", max_num_seqs=16, **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs], llm


@pytest.mark.parametrize("model, kv", [("llama", "fp8_e4m3"), ("llama_gqa", "int8"), ("qwen3", "bfloat16"),
                                       ("mistral_swa", "fp8_e4m3"), ("gemma3", "fp8_e4m3"), ("phi3", "int4"),
                                       ("gemma3", "fp4_e2m1"), ("gemma3", "int4_per_group32")])
@pytest.mark.parametrize("batch", [1, 3])
def test_replayed_decode_steps_equal_eager_ones(tiny_models, model, kv, batch):
    prompts = PROMPTS[:batch] if batch == 1 else PROMPTS[1:]
    expected, eager = _run(tiny_models[model], prompts, kv_cache_dtype=kv, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    got, llm = _run(tiny_models[model], prompts, kv_cache_dtype=kv)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and set(graphs.buckets) == {1, 2, 4, 8}
    assert all(isinstance(b.graph, CPUGraph) for b in graphs.buckets.values())
    assert graphs.replays >= 10   # every decode step of the 12 tokens but the first (a prefill)
    assert got == expected


def test_a_batch_above_the_largest_bucket_runs_eagerly(tiny_llama):
    prompts = [[5 + i, 7, 9 + i] for i in range(CPU_GRAPH_MAX_BATCH + 1)]
    expected, _ = _run(tiny_llama, prompts, enforce_eager=True)
    got, llm = _run(tiny_llama, prompts)
    assert got == expected and llm.engine.runner.graphs.replays == 0


def test_a_refused_capture_leaves_every_step_eager(tiny_llama, monkeypatch, caplog):
    def refuse(self):
        raise CaptureRefused("the forward calls aten.item.default")

    monkeypatch.setattr(DecodeGraphs, "capture_all", refuse)
    with caplog.at_level(logging.INFO, logger="kv8"):
        got, llm = _run(tiny_llama, PROMPTS[:2])
    assert llm.engine.runner.graphs is None
    assert "decode steps run eagerly: the forward calls aten.item.default" in caplog.text
    expected, _ = _run(tiny_llama, PROMPTS[:2], enforce_eager=True)
    assert got == expected
