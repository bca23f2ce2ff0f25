"""scripts/write_random_gguf.py: its Q4_K blocks (the gguf package's dequantization as the oracle), and a tiny model
written by the same functions that loads with ``quantization="gguf"`` keeping every weight as the file's blocks,
within 10% of the file's tensor bytes, and decodes through an engine."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kv8 import LLM, SamplingParams
from kv8.layers.linear import GGUFSegment, LinearBase
from kv8.loader.gguf import read_gguf
from kv8.loader.model import load_model, resident_weight_bytes
from tests.helpers.paths import ROOT, load_file_module

SCRIPT = ROOT / "scripts" / "write_random_gguf.py"


def _script() -> ModuleType:
    return load_file_module(SCRIPT)


def _tiny_shape(w):
    return w.ModelShape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=300, context=256)


def test_random_q4_k_blocks_have_zero_mean_and_the_asked_spread() -> None:
    w = _script()
    blocks = w.random_q4_k(64, 1024, np.random.default_rng(0), std=0.02)
    assert blocks.dtype == np.uint8 and blocks.shape == (64, 1024 // 256 * 144)
    values = gguf.quants.dequantize(blocks, QT.Q4_K)
    assert values.shape == (64, 1024) and np.isfinite(values).all()
    assert abs(values.mean()) < 5e-4 and 0.019 < values.std() < 0.021
    with pytest.raises(ValueError, match="in_features=100 is not a multiple of 256"):
        w.random_q4_k(1, 100, np.random.default_rng(0))


def test_the_shape_is_checked() -> None:
    w = _script()
    assert w.LLAMA_31_8B.head_dim == 128 and w.LLAMA_31_8B.vocab == 128256
    with pytest.raises(ValueError, match=r"ModelShape.intermediate=300 must be a multiple of 256"):
        w.ModelShape(hidden=256, layers=1, heads=4, kv_heads=2, intermediate=300, vocab=300)
    with pytest.raises(ValueError, match=r"ModelShape.vocab=10 must be at least 258"):
        w.ModelShape(hidden=256, layers=1, heads=4, kv_heads=2, intermediate=256, vocab=10)


def test_a_tiny_model_keeps_every_weight_as_the_files_blocks(tmp_path: Path) -> None:
    """Every decoder linear layer, the embedding and the LM head hold Q4_K blocks (nothing expanded), and the model's
    resident weights are within 10% of the file's tensor bytes (what write_random_gguf returns)."""
    w = _script()
    path = tmp_path / "random.gguf"
    tensor_bytes = w.write_random_gguf(str(path), _tiny_shape(w), seed=1)
    model, reader = read_gguf(str(path))
    assert tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert model.hf_config["rope_theta"] == 500000.0 and model.hf_config["vocab_size"] == 300
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {QT.Q4_K}
    loaded = load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")
    layers = {name: m for name, m in loaded.model.named_modules() if isinstance(m, LinearBase)}
    assert len(layers) == 2 * 4 + 1   # qkv, o, gate/up, down per layer; the LM head
    segments = [s for m in layers.values() for s in m.gguf_segments]
    assert all(isinstance(s, GGUFSegment) and s.qtype == "Q4_K" and not s.expanded for s in segments)
    embedding = loaded.model.model.embed_tokens
    assert embedding.gguf_rows is not None and embedding.gguf_rows.qtype == "Q4_K"
    assert not any(p.numel() for m in layers.values() for p in m.parameters())
    resident = resident_weight_bytes(loaded.model)
    assert abs(resident - tensor_bytes) <= 0.1 * tensor_bytes, (resident, tensor_bytes)
    assert resident <= os.path.getsize(path)


def test_a_tiny_model_decodes_with_its_byte_vocabulary(tmp_path: Path) -> None:
    """An engine tokenizes any text with the byte vocabulary (one token per byte) and decodes tokens of the model's
    vocabulary with an FP8 cache."""
    w = _script()
    path = tmp_path / "random.gguf"
    w.write_random_gguf(str(path), _tiny_shape(w), seed=2)
    llm = LLM(str(path), quantization="gguf", kv_cache_dtype="fp8", kv_cache_memory="8MiB", max_model_len=128)
    prompt = "Héllo, world"
    assert llm.get_tokenizer()(prompt).input_ids == list(prompt.encode())
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    llm.close()
    ids = out.outputs[0].token_ids
    assert out.prompt_token_ids == list(prompt.encode()) and len(ids) == 6 and all(0 <= i < 300 for i in ids)


def test_main_writes_the_file_and_refuses_a_tokenizer_of_another_size(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    w = _script()
    small = ["--hidden", "256", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "256",
             "--context", "128"]
    first = tmp_path / "a.gguf"
    assert w.main([str(first), *small, "--vocab", "260"]) == 0
    assert "wrote" in capsys.readouterr().out
    copy = tmp_path / "b.gguf"   # the tokenizer copied from a file of the same vocabulary
    assert w.main([str(copy), *small, "--vocab", "260", "--tokenizer-from", str(first)]) == 0
    tokens = [read_gguf(str(p))[1].fields["tokenizer.ggml.tokens"].contents() for p in (first, copy)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 260
    assert w.main([str(tmp_path / "c.gguf"), *small, "--vocab", "300", "--tokenizer-from", str(first)]) == 2
    assert "its vocabulary has 260 tokens, the model 300" in capsys.readouterr().err
