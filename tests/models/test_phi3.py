"""Phi-3 against Hugging Face transformers on tiny random configs: the fused checkpoint, LongRoPE, partial rotary.

Models (all with ``sliding_window=None`` except the one sliding-window test):

* ``phi3`` -- the tiny Phi-3 of tests/helpers/tiny_models.py (no rope scaling);
* ``longrope`` -- LongRoPE with distinct short and long factors, ``original_max_position_embeddings=32`` and
  ``max_position_embeddings=128``, so the 43-token sequences here cross into the long factors;
* ``partial`` -- the same plus ``partial_rotary_factor=0.5`` (Phi-4-mini style) and tied embeddings.

kv8 picks the long factors per token by its own position (:mod:`kv8.layers.rotary`). Transformers picks them per
forward, from the largest position; the two agree when transformers prefills the first 32 tokens and then
decodes one token at a time, which is the oracle here (:func:`hf_incremental_logits`), while kv8 prefills in
chunks that cross position 32 ([20, 17] then 6 decode steps). FP8 caches are held against transformers reading
K/V rounded by ml_dtypes (:func:`tests.helpers.hf.register_fp8_attention`).
"""

from __future__ import annotations

import glob
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from kv8 import LLM, SamplingParams
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.loader.model import load_model
from kv8.models.phi3 import Phi3ArchConfig, Phi3ForCausalLM
from kv8.models.registry import arch_config, model_class
from kv8.observer import EngineObserver
from tests.helpers.hf import FP8_NP, edited_checkpoint, hf_logits, register_fp8_attention, run_paged
from tests.helpers.kernels import dense_kernels_or_reason, prefill_logits
from tests.helpers.tiny_models import make_tiny_model

DENSE_KERNELS, DENSE_WHY = dense_kernels_or_reason()
ORIGINAL = 32   # original_max_position_embeddings of the longrope models
CHUNKS = [20, 17] + [1] * 6
# copied wherever used: transformers adds keys to the rope_scaling dict it is given
LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.05 * i for i in range(8)],
                long_factor=[1.5 + 0.75 * i for i in range(8)])
MODELS = {
    "phi3": {},
    "longrope": dict(max_position_embeddings=128, original_max_position_embeddings=ORIGINAL,
                     rope_scaling=dict(LONGROPE)),
    "partial": dict(max_position_embeddings=128, original_max_position_embeddings=ORIGINAL,
                    rope_scaling=dict(LONGROPE, short_factor=LONGROPE["short_factor"][:4],
                                      long_factor=LONGROPE["long_factor"][:4]),
                    partial_rotary_factor=0.5, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def phi3_models(tiny_models, tmp_path_factory) -> dict[str, str]:
    out = {"phi3": tiny_models["phi3"]}
    for name, overrides in MODELS.items():
        if overrides:
            out[name] = make_tiny_model(str(tmp_path_factory.mktemp(f"phi3_{name}")), "phi3", seed=3, **overrides)
    return out


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return torch.randint(3, 300, (43,), generator=torch.Generator().manual_seed(7)).tolist()


def _hf_model(path: str, kv_name: str = "float32"):
    from transformers import AutoModelForCausalLM

    attn = register_fp8_attention(kv_name) if kv_name in FP8_NP else "eager"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


def hf_incremental_logits(path: str, tokens: list[int], prefill: int = ORIGINAL,
                          kv_name: str = "float32") -> torch.Tensor:
    """Transformers' logits [len(tokens), V]: ``prefill`` tokens in one forward, then one token per forward with
    its KV cache (as its own generation runs)."""
    model = _hf_model(path, kv_name)
    with torch.no_grad():
        out = model(torch.tensor([tokens[:prefill]]), use_cache=True)
        rows = [out.logits[0]]
        for t in tokens[prefill:]:
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0])
    return torch.cat(rows).float()


def hf_greedy(path: str, prompt: list[int], n: int, kv_name: str = "float32") -> list[int]:
    model = _hf_model(path, kv_name)
    out_tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out_tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[out_tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return out_tokens


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / float(want.std())


# ---- model and loading

def test_registry_and_config(phi3_models):
    assert model_class({"model_type": "phi3"}) is Phi3ForCausalLM
    assert model_class({"architectures": ["Phi3ForCausalLM"]}) is Phi3ForCausalLM
    loaded = load_model("hf", phi3_models["partial"], torch.float32)
    arch = loaded.arch
    assert isinstance(arch, Phi3ArchConfig) and arch.rotary_dim == 8 and arch.head_dim == 16
    rs = arch.rope_scaling
    assert rs is not None and rs.rope_type == "longrope" and rs.original_max_position_embeddings == ORIGINAL
    assert rs.factor == 4.0 and rs.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight   # tied
    # the fused checkpoint tensors are the merged layers' parameters, as stored
    (file,) = glob.glob(os.path.join(phi3_models["partial"], "*.safetensors"))
    ckpt = load_file(file)
    for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        assert torch.equal(loaded.model.get_parameter(name), ckpt[name])


def test_loader_checks_the_fused_tensors_shape(phi3_models, tmp_path):
    path = edited_checkpoint(phi3_models["phi3"], str(tmp_path / "shape"), lambda t: t.update(
        {"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(96, 96)}))
    with pytest.raises(ValueError, match=r"checkpoint tensor model\.layers\.0\.self_attn\.qkv_proj\.weight has shape "
                                         r"\(96, 96\), the model expects \(160, 96\)"):
        load_model("hf", path, torch.float32)
    path = edited_checkpoint(phi3_models["phi3"], str(tmp_path / "split"), lambda t: t.update(
        {"model.layers.0.mlp.gate_proj.weight": t.pop("model.layers.0.mlp.gate_up_proj.weight")[:192]}))
    with pytest.raises(ValueError, match=r"tensors kv8 does not know \(1, e\.g\. model\.layers\.0\.mlp\.gate_proj"):
        load_model("hf", path, torch.float32)


# ---- logits against transformers

@pytest.mark.parametrize("name", list(MODELS))
def test_float32_logits_match_transformers(phi3_models, tokens, name):
    """Chunked prefill across position 32 and 6 decode steps beyond it: every position's logits."""
    got = run_paged(phi3_models[name], "float32", tokens, CHUNKS)
    want = hf_incremental_logits(phi3_models[name], tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    if name == "phi3":   # no long factors: transformers' one-forward logits are the same
        torch.testing.assert_close(got, hf_logits(phi3_models[name], tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kv_name", list(FP8_NP))
def test_fp8_logits_match_transformers_with_fp8_rounded_kv(phi3_models, tokens, name, kv_name):
    got = run_paged(phi3_models[name], kv_name, tokens, CHUNKS)
    want = hf_incremental_logits(phi3_models[name], tokens, kv_name=kv_name)
    err = _relative_error(got, want)
    assert err <= 2e-3, f"{name} {kv_name}: relative max error {err:.2e}"
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_long_factors_are_chosen_per_token(phi3_models, tokens):
    """Any chunking gives the same logits: the choice depends on each token's position only. Transformers'
    one-forward prefill of all 43 tokens uses the long factors at positions below 32 too (the difference stated
    in kv8.layers.rotary), so its logits there differ from kv8's."""
    path = phi3_models["longrope"]
    whole = run_paged(path, "float32", tokens, [len(tokens)])
    torch.testing.assert_close(run_paged(path, "float32", tokens, [5, 27, 1, 10]), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(run_paged(path, "float32", tokens, CHUNKS), whole, rtol=1e-4, atol=1e-4)
    one_forward = hf_logits(path, tokens)   # transformers: long factors for all 43 positions
    assert _relative_error(whole[:ORIGINAL], one_forward[:ORIGINAL]) > 0.05


@pytest.mark.parametrize("name", ["phi3", "partial"])
@pytest.mark.parametrize("kv_name", ["float32", *FP8_NP])
def test_engine_greedy_tokens_equal_transformers(phi3_models, name, kv_name):
    """The whole engine (scheduler, cache, fused attention): greedy decoding from a 20-token prompt through
    position 32 and on gives transformers' tokens."""
    prompt = [3 + (11 * i) % 290 for i in range(20)]
    llm = LLM(model=phi3_models[name], dtype="float32", kv_cache_dtype=kv_name, max_model_len=128,
              num_kv_blocks=16, block_size=8)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(phi3_models[name], prompt, 24, kv_name)


@pytest.mark.skipif(DENSE_KERNELS is None, reason=f"kv8's dense kernels are unavailable: {DENSE_WHY}")
@pytest.mark.parametrize("name", ["phi3", "longrope", "partial"])
def test_engine_with_packed_kernels_matches_torch(phi3_models, name):
    """bf16 with torch's dense layers and with kv8's packed kernels (fused RoPE kernel for full rotary, torch
    RoPE for partial): the logits of a 40-token prompt (crossing position 32) agree to bf16 noise."""
    prompt = [3 + (7 * i) % 40 for i in range(40)]
    ref, _ = prefill_logits(phi3_models[name], "torch", prompt)
    got, tokens = prefill_logits(phi3_models[name], "packed_bf16", prompt)
    assert got.shape == ref.shape and len(tokens) == 4
    assert float((got - ref).abs().max()) <= 0.05 * float(ref.std())
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95


def test_prompt_longer_than_the_sliding_window_matches_transformers(tmp_path):
    """Phi-3-mini-4k has a sliding window; here 8 tokens, and a 30-token prompt plus 10 greedy tokens: the
    engine's prompt logits and greedy tokens equal transformers' (which masks keys more than 7 positions back)."""
    path = make_tiny_model(str(tmp_path), "phi3", seed=5, sliding_window=8)
    prompt = [3 + (13 * i) % 290 for i in range(30)]
    rows: list[torch.Tensor] = []

    class Rows(EngineObserver):
        def on_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
            rows.append(logits)

    engine = LLMEngine(EngineArgs(model=path, dtype="float32", num_kv_blocks=16, block_size=8, max_model_len=64,
                                  max_num_batched_tokens=16), Rows())
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    # prompt logits: one row per prompt token after the first (the logits that scored it)
    torch.testing.assert_close(torch.cat(rows), hf_logits(path, prompt)[:-1], rtol=1e-4, atol=1e-4)
    assert tokens == hf_greedy(path, prompt, 10)


# ---- config errors

def _config(**kw) -> dict:
    cfg = dict(model_type="phi3", vocab_size=64, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128, hidden_act="silu",
               original_max_position_embeddings=ORIGINAL, rope_scaling=dict(LONGROPE))
    cfg.update(kw)
    return cfg


def test_config_reads_phi3_spellings():
    su = {"type": "su", "short_factor": LONGROPE["short_factor"], "long_factor": LONGROPE["long_factor"]}
    arch = arch_config(_config(rope_scaling=su))   # early Phi-3-mini-128k configs
    assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == "longrope"
    # transformers 5 writes rope_parameters (with partial_rotary_factor) instead of rope_scaling
    params = dict(LONGROPE, short_factor=[1.0] * 4, long_factor=[2.0] * 4, partial_rotary_factor=0.5,
                  original_max_position_embeddings=ORIGINAL, rope_theta=500.0)
    arch = arch_config(_config(rope_scaling=None, rope_parameters=params,
                                                  original_max_position_embeddings=None))
    assert isinstance(arch, Phi3ArchConfig) and arch.rotary_dim == 8 and arch.rope_theta == 500.0
    assert arch.rope_scaling is not None and arch.rope_scaling.long_factor == (2.0,) * 4
    arch = arch_config(_config(rope_scaling=dict(LONGROPE, attention_factor=1.25, factor=2.0)))
    rs = arch.rope_scaling
    assert rs is not None and (rs.attention_factor, rs.factor) == (1.25, 2.0)
    # Phi-3-mini-4k: no scaling, a sliding window on every layer
    arch = arch_config(_config(rope_scaling=None, sliding_window=2047))
    assert arch.rope_scaling is None and arch.layer_windows == (2047, 2047)


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported for phi3; kv8 implements silu"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor=1\.5 must be a finite number in \(0, 1\]"),
    (dict(partial_rotary_factor=0.1875, rope_scaling=None),
     r"partial_rotary_factor=0\.1875 rotates int\(head_dim \* factor\) = 3 dims of head_dim=16; kv8 needs an even"),
    (dict(partial_rotary_factor=0.5),
     r"short_factor and long_factor have 8 entries; this model rotates 8 dims per head and needs 4 \(rotary dim / "),
    (dict(rope_scaling=dict(LONGROPE, short_factor=[1.0] * 7, long_factor=[1.0] * 7)),
     r"have 7 entries; this model rotates 16 dims per head and needs 8"),
    (dict(rope_scaling=dict(LONGROPE, short_factor=[1.0] * 4)),
     r"has 4 short_factor and 8 long_factor entries; they must be equally long"),
    (dict(rope_scaling=dict(LONGROPE, long_factor=[1.0] * 7 + [0.0])),
     r"long_factor has 0\.0; every factor must be a finite number > 0"),
    (dict(rope_scaling=dict(LONGROPE, short_factor=[float("inf")] * 8)), r"short_factor has inf"),
    (dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8)),
     r"long_factor=None must be a non-empty list of numbers"),
    (dict(original_max_position_embeddings=None),
     r"longrope\) needs original_max_position_embeddings \(in rope_scaling or at the top level"),
    (dict(rope_scaling=dict(LONGROPE, attention_factor=-1.0)), r"attention_factor=-1\.0 must be a finite number > 0"),
    (dict(rope_scaling=dict(type="yarn", factor=4.0)),
     r"rope_scaling type 'yarn' is not supported; kv8 supports: linear, llama3, longrope"),
    (dict(attention_bias=True), r"attention_bias=True is not supported for phi3"),
])
def test_unsupported_config_features_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        arch_config(_config(**change))
