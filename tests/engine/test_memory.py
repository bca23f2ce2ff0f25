"""kv8.engine.memory: the parameters it counts against transformers' models of the same configs (built on the meta
device: no memory), Llama-3.1-8B's published count, and what the GPU budget leaves out for the weights and a step."""

from __future__ import annotations

import pytest
import torch

from kv8.engine.args import EngineArgs
from kv8.engine.memory import estimate_device_reserve, num_parameters
from kv8.models.registry import arch_config
from tests.helpers.tiny_models import TINY_CONFIGS

BASE = dict(vocab_size=384, hidden_size=96, intermediate_size=192, num_hidden_layers=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
# Llama-3.1-8B's config.json (shapes): 8,030,261,248 parameters
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)


def _hf_config(name: str) -> dict:
    model_type, extra = TINY_CONFIGS[name]
    return dict(BASE, model_type=model_type, **extra)


def _transformers_count(cfg: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())   # tied embeddings are one parameter


@pytest.mark.parametrize("name", ["llama", "llama_gqa", "qwen2", "mistral_swa", "phi3"])
def test_parameter_count_is_transformers(name: str) -> None:
    cfg = _hf_config(name)
    assert sum(num_parameters(arch_config(cfg))) == _transformers_count(cfg)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_models_with_more_norms_are_counted_short_by_those_norms_only(name: str) -> None:
    cfg = _hf_config(name)
    arch = arch_config(cfg)
    short = _transformers_count(cfg) - sum(num_parameters(arch))
    # Qwen3: q_norm and k_norm per layer; Gemma 3: those and two more layer norms
    assert 0 < short <= arch.num_layers * (2 * arch.hidden_size + 2 * arch.head_dim)


def test_llama_8b_weights() -> None:
    arch = arch_config(LLAMA_8B)
    assert sum(num_parameters(arch)) == 8_030_261_248
    bf16 = estimate_device_reserve(arch, torch.bfloat16, fp8_codes=False, tp_size=1, kv_heads=8,
                                   max_num_batched_tokens=2048, max_num_seqs=64)
    assert bf16.weights == 2 * 8_030_261_248
    fp8 = estimate_device_reserve(arch, torch.bfloat16, fp8_codes=True, tp_size=1, kv_heads=8,
                                  max_num_batched_tokens=2048, max_num_seqs=64)
    projections, others = num_parameters(arch)
    rows = 32 * (4096 + 2 * 1024 + 2 * 4096 + 2 * 14336)   # q, k, v, o, gate, up, down: a float32 scale per row
    assert fp8.weights == projections + 4 * rows + 2 * others
    assert fp8.activations == bf16.activations > 0


def test_ranks_hold_their_share() -> None:
    arch = arch_config(LLAMA_8B)
    one, two = num_parameters(arch), num_parameters(arch, tp_size=2)
    assert two[0] * 2 == one[0]
    assert two[1] == 128256 // 2 * 4096 * 2 + 65 * 4096   # half of each vocabulary matrix; the norms whole
    # 16 ranks over 8 KV heads: one KV head each (replicated), so k and v do not halve again
    sixteen = num_parameters(arch, tp_size=16)[0]
    assert sixteen == 32 * (4096 * (256 + 2 * 128) + 256 * 4096 + 3 * 4096 * 896)


def test_activations_grow_with_the_step() -> None:
    arch = arch_config(LLAMA_8B)
    small, large = (estimate_device_reserve(arch, torch.bfloat16, fp8_codes=False, tp_size=1, kv_heads=8,
                                            max_num_batched_tokens=t, max_num_seqs=s).activations
                    for t, s in ((512, 8), (8192, 256)))
    per_token = 2 * 4096 + (64 + 16) * 128 + 3 * 14336
    assert large - small == 2 * ((8192 - 512) * per_token * 2 + 3 * (256 - 8) * 128256 * 4)


def test_the_cpu_reserves_nothing() -> None:
    config = EngineArgs(device="cpu").create_engine_config(dict(BASE, model_type="llama", num_attention_heads=4,
                                                                num_key_value_heads=4), "hf", "/m")
    assert config.device_reserve().weights == config.device_reserve().activations == 0
    assert config.kv_budget().reserve == config.device_reserve()
