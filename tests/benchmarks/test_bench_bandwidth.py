"""``benchmarks/bench_bandwidth.py``: the bytes it says a SmolLM2-135M decode step reads, against the model itself
(transformers' Llama built on the meta device from SmolLM2-135M's configuration), and its command line."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.helpers.paths import ROOT, load_file_module

bench = load_file_module(ROOT / "benchmarks" / "bench_bandwidth.py")


def test_weight_bytes_match_smollm2():
    from transformers import LlamaConfig, LlamaForCausalLM

    # SmolLM2-135M-Instruct's config.json (the values kv8 reads from its GGUF)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # every matrix a step reads once (the tied embedding is the LM head); norm vectors are negligible and left out
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2)
    weights, kv = bench.step_bytes(8, 1000, 1)
    assert weights == 2 * matrices
    assert kv == 8 * 1000 * 30 * 2 * 3 * 64   # K and V, 3 KV heads of 64, one byte per value


def test_bad_arguments_name_the_option():
    for args, needle in ((["--sizes-mib", "0"], "--sizes-mib"), (["--threads", "0"], "--threads")):
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_bandwidth.py"), *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and needle in out.stderr, out.stderr
