"""A per-layer KV plan (``kv_cache_plan``) end to end: each pool in its own format and rotation, greedy tokens
independent of batching, chunked prefill, prefix caching and preemption; a plan equal to the same layers set by
``kv_cache_dtype_skip_layers``; every error of the option; ``kv8 info`` with a plan.

Models: a 4-layer variant of the tiny ``llama_gqa`` (full attention, head_dim 16) and the tiny ``gemma3`` (layers 0,
1 and 3 sliding, window 16; layer 2 global; head_dim 32) from tests/helpers/tiny_models.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kv8 import SamplingParams
from kv8.cache.codec import K, V
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.loader.model import read_model_config
from kv8.observer import EngineObserver
from tests.helpers.engine import PROMPTS, assert_greedy_match, check_all_blocks_free, make_llm, tokens_of
from tests.helpers.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
GREEDY_LP = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
PROMPTS = PROMPTS[:4]

# layer 0 bfloat16, layer 1 int4 + Hadamard, the rest the cache's fp8_e4m3: three pools
MIXED = {"0": {"kv_cache_dtype": "bfloat16"}, "1": {"kv_cache_dtype": "int4", "kv_cache_rotation": "hadamard"}}
# gemma3: the global layer in bfloat16, sliding layer 0 int8 + Hadamard, the rest fp8_e4m3
GEMMA = {"2": {"kv_cache_dtype": "bfloat16"}, "0": {"kv_cache_dtype": "int8", "kv_cache_rotation": "hadamard"}}


def write_plan(path: Path, layers: dict, version: object = 1) -> str:
    path.write_text(json.dumps({"kv8_kv_plan": version, "layers": layers}))
    return str(path)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("llama4")), "llama_gqa", num_hidden_layers=4)


@pytest.fixture(scope="module")
def models(llama4, tiny_models) -> dict[str, str]:
    return {"llama4": llama4, "gemma3": tiny_models["gemma3"]}


@pytest.mark.parametrize("model,layers,pools", [
    ("llama4", MIXED, [("fp8_e4m3", "none", [2, 3]), ("bfloat16", "none", [0]),
                       ("int4_per_token_head", "hadamard", [1])]),
    ("gemma3", GEMMA, [("fp8_e4m3", "none", [1, 3]), ("int8_per_token_head", "hadamard", [0]),
                       ("bfloat16", "none", [2])]),
])
def test_a_mixed_plan_gives_identical_tokens_whatever_the_batching(models, tmp_path, model, layers, pools):
    path = models[model]
    plan = dict(kv_cache_dtype="fp8_e4m3", kv_cache_plan=write_plan(tmp_path / "plan.json", layers))
    alone = make_llm(path, **plan, enable_prefix_caching=False, disable_hybrid_kv_cache_manager=True)
    assert [(c.kv_dtype.name, c.codec.rotation_name, sorted(c.slots)) for c in alone.engine.caches] == pools
    expected = [alone.generate(p, GREEDY_LP)[0].outputs[0] for p in PROMPTS]
    # continuous batching with chunked prefill
    llm = make_llm(path, **plan, enable_prefix_caching=False, max_num_batched_tokens=16, block_size=4)
    assert_greedy_match([o.outputs[0] for o in llm.generate(PROMPTS, GREEDY_LP)], expected)
    check_all_blocks_free(llm)
    # prefix caching: the second pass hits cached blocks in every pool
    llm = make_llm(path, **plan, block_size=4)
    first, again = llm.generate(PROMPTS, GREEDY_LP), llm.generate(PROMPTS, GREEDY_LP)
    assert_greedy_match([o.outputs[0] for o in first], expected)
    assert_greedy_match([o.outputs[0] for o in again], expected)
    assert any(o.num_cached_tokens > 0 for o in again)
    check_all_blocks_free(llm)
    # preemption: a budget of about 1.3 sequences of 72 tokens, split between the pools by need
    b = llm.engine.config.kv_budget()
    small = dict(plan, max_model_len=72, block_size=4, max_num_batched_tokens=16)
    need = make_llm(path, **small).engine.config.kv_budget()
    one_seq = sum(n * bb for n, bb in zip(need.blocks_per_sequence(), need.block_bytes))
    llm = make_llm(path, **small, kv_cache_memory=int(1.3 * one_seq))
    assert_greedy_match([o.outputs[0] for o in llm.generate(PROMPTS, GREEDY_LP)], expected)
    assert llm.engine.scheduler.num_preemptions > 0
    check_all_blocks_free(llm)
    assert len(b.layout.pools) == 3 and b.bytes_per_token == sum(r[2] for r in b.pool_rows())


class _Keys(EngineObserver):
    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.codecs: dict[int, object] = {}

    def on_kv_store(self, layer, key, value, codec) -> None:
        self.kv.setdefault(layer, (key.clone(), value.clone()))   # the prompt's, from the first step
        self.codecs[layer] = codec


def test_each_pool_holds_what_its_codec_stores(llama4, tmp_path):
    """After a prefill, each layer's blocks in its pool decode to the pool codec's round trip of the K/V the layer
    stored (in that codec's basis); the pools' tensors have their formats' dtypes and widths."""
    observer = _Keys()
    engine = LLMEngine(EngineArgs(model=llama4, dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
                                  kv_cache_dtype="fp8_e4m3",
                                  kv_cache_plan=write_plan(tmp_path / "plan.json", MIXED)), observer)
    engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "r")
    engine.step()   # the whole prompt in one step
    tables = engine.kv_manager.block_ids("r")
    layout = engine.layout
    assert [(c.k_data.dtype, c.k_data.shape[-1], c.k_token_scales is not None) for c in engine.caches] == [
        (torch.uint8, 16, False), (torch.bfloat16, 16, False), (torch.uint8, 8, True)]
    for layer in range(4):
        group = layout.groups[layout.layer_group[layer]]
        cache = engine.caches[group.pool]
        assert observer.codecs[layer] is cache.codec
        k, v = observer.kv[layer]
        got = cache.gather(layer, torch.tensor(tables[group.group_id]), k.shape[0], torch.float32)
        for which, x in ((K, k), (V, v)):
            expected, _ = cache.codec.round_trip(x, layer, which)
            torch.testing.assert_close(got[which], expected, rtol=0, atol=0)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_plan_equals_the_same_layers_set_by_skip_layers(llama4, tmp_path):
    """Layers 0 and 3 in the compute dtype by a plan ("auto") or by kv_cache_dtype_skip_layers: the same pools,
    the same tokens, exactly."""
    by_skip = make_llm(llama4, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="0,3")
    by_plan = make_llm(llama4, kv_cache_dtype="fp8", kv_cache_plan=write_plan(
        tmp_path / "plan.json", {"0": {"kv_cache_dtype": "auto"}, "3": {"kv_cache_dtype": "float32"}}))
    assert [(c.kv_dtype.name, sorted(c.slots)) for c in by_plan.engine.caches] == [
        (c.kv_dtype.name, sorted(c.slots)) for c in by_skip.engine.caches] == [("fp8_e4m3", [1, 2]),
                                                                              ("float32", [0, 3])]
    assert tokens_of(by_plan.generate(PROMPTS, GREEDY)) == tokens_of(by_skip.generate(PROMPTS, GREEDY))


def _config(path: str, **kw):
    """The EngineConfig of the options (validated against the model; nothing loaded)."""
    hf = read_model_config("hf", path)
    hf.update(kw.pop("hf", {}))
    return EngineArgs(model=path, dtype="float32", **kw).create_engine_config(hf, "hf", path)


def test_every_error_of_the_option(llama4, tmp_path, monkeypatch):
    written = iter(range(100))

    def plan(layers, version=1):
        return write_plan(tmp_path / f"p{next(written)}.json", layers, version)

    errors = [
        (dict(kv_cache_plan=str(tmp_path / "missing.json")), r"kv_cache_plan='.*missing.json': no such file"),
        (dict(kv_cache_plan=str((tmp_path / "bad.json").write_text("{") and tmp_path / "bad.json")), "is not JSON"),
        (dict(kv_cache_plan=plan({}, 2)), "kv8_kv_plan is 2; this kv8 reads plan files of version 1"),
        (dict(kv_cache_plan=plan({}, True)), "kv8_kv_plan is True"),
        (dict(kv_cache_plan=plan({"7": {"kv_cache_dtype": "fp8"}})),
         r"has layer 7, but the model has 4 layers \(0..3\)"),
        (dict(kv_cache_plan=plan({"x": {}})), "layer 'x' must be a layer index >= 0"),
        (dict(kv_cache_plan=plan({"1": "fp8"})), "layer 1 must be an object"),
        (dict(kv_cache_plan=plan({"1": {"dtype": "fp8"}})), r"layer 1 has unknown keys \['dtype'\]; allowed: "
                                                            "kv_cache_dtype, kv_cache_rotation"),
        (dict(kv_cache_plan=plan({"1": {"kv_cache_dtype": "int3"}})),
         "layer 1: kv_cache_dtype='int3' is not supported; choose one of: auto, .*int4_per_token_head.*K/V pair"),
        (dict(kv_cache_plan=plan({"1": {"kv_cache_rotation": "givens"}})),
         "layer 1: kv_cache_rotation='givens' is not supported; choose none, hadamard, or keys/values apart"),
        (dict(kv_cache_plan=plan({"1": {"kv_cache_rotation": "hadamard"}}), hf=dict(head_dim=24)),
         r"kv_cache_rotation='hadamard' \(kv_cache_plan: layers \[1\]\) needs a power-of-two head_dim; .*24"),
        (dict(kv_cache_plan=plan({"1": {"kv_cache_dtype": "fp8"}}), kv_cache_dtype_skip_layers="0"),
         "kv_cache_plan=.* and kv_cache_dtype_skip_layers both set layers' formats; give one of them"),
        (dict(kv_cache_plan=plan({"1": {"kv_cache_dtype": "int8"}}), kv_cache_scale_mode="dynamic"),
         "kv_cache_scale_mode='dynamic' applies to a plan's FP8 layers, but neither kv_cache_dtype='auto' nor"),
        (dict(kv_cache_plan=plan({"1": {"kv_cache_dtype": "int8"}}), quantization_param_path="s.json"),
         "quantization_param_path='s.json' gives static scales for a plan's FP8 layers, but neither"),
        (dict(kv_cache_plan=plan({"1": {"kv_cache_dtype": "fp8"}}), kv_cache_scale_mode="dynamic",
              quantization_param_path="s.json"), "kv_cache_scale_mode='dynamic' computes them per token"),
        (dict(kv_cache_dtype="fp8", quantization_param_path="s.json", kv_cache_plan=plan(
            {str(i): {"kv_cache_dtype": "bfloat16"} for i in range(4)})),
         "no layer of kv_cache_plan=.* is stored in FP8; drop quantization_param_path"),
    ]
    for kw, message in errors:
        with pytest.raises(ValueError, match=message):
            _config(llama4, **kw)
    # a layer's entry may give one key; the other comes from the option
    config = _config(llama4, kv_cache_dtype="fp8", kv_cache_rotation="hadamard",
                     kv_cache_plan=plan({"1": {"kv_cache_dtype": "int4"}, "2": {"kv_cache_rotation": "none"}}))
    assert [s.describe() for s in config.kv_plan().specs] == [
        "fp8_e4m3 + hadamard", "int4_per_token_head + hadamard", "fp8_e4m3"]
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # every kv8 format's layers are read by the triton kernels: int8, int4 (per token and head), fp4_e2m1 (this
    # model's head_dim 16 is no multiple of int4_per_group32's 32)
    for name in ("int8", "int4", "fp4_e2m1"):
        assert _config(llama4, attention_backend="triton", kv_cache_plan=plan({"1": {"kv_cache_dtype": name}}))
    assert _config(llama4, attention_backend="triton", kv_cache_dtype="int4").cache.kv_cache_dtype == "int4"
    assert _config(llama4, attention_backend="triton", kv_cache_dtype="fp4_e2m1").cache.kv_cache_dtype == "fp4_e2m1"
    # a layer whose format the kernels could not derive is refused up front, naming it and why
    import kv8.kernels.triton.formats as triton_formats

    def refuse(fmt: object) -> object:
        raise ValueError(f"group format {getattr(fmt, 'name', fmt)!r}: not for these kernels")

    monkeypatch.setattr(triton_formats, "kernel_format", refuse)
    with pytest.raises(ValueError, match=r"stores layer 1 as fp4_e2m1: the triton attention backend \(the GPU path\) "
                                         r"cannot read this format \(group format 'e2m1': not for these kernels\)"):
        _config(llama4, attention_backend="triton", kv_cache_plan=plan({"1": {"kv_cache_dtype": "fp4_e2m1"}}))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8': the triton attention backend .* cannot read"):
        _config(llama4, attention_backend="triton", kv_cache_dtype="int8")


def test_static_scales_apply_to_the_fp8_layers_in_their_basis(llama4, tmp_path):
    """A vLLM scales file gives the FP8 layers their scales (the int4 layer has none); an FP8 layer rotated unlike
    the file's basis is refused when the scales are resolved."""
    scales = tmp_path / "kv_cache_scales.json"
    scales.write_text(json.dumps({"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {str(i): 0.5 for i in range(4)}}}}))
    llm = make_llm(llama4, kv_cache_dtype="fp8", quantization_param_path=str(scales), kv_cache_plan=write_plan(
        tmp_path / "plan.json", {"1": {"kv_cache_dtype": "int4"}}))
    fp8, int4 = llm.engine.caches
    assert fp8.codec.layer_scales(2)[0].item() == 0.5 and int4.codec.scales is None
    with pytest.raises(ValueError, match="calibrated with rotation 'none', but kv_cache_rotation='hadamard'"):
        make_llm(llama4, kv_cache_dtype="fp8", quantization_param_path=str(scales), kv_cache_plan=write_plan(
            tmp_path / "plan2.json", {"1": {"kv_cache_rotation": "hadamard"}}))


def test_info_shows_the_plans_pools(llama4, tmp_path, capsys):
    from kv8.entrypoints.cli import main

    plan = write_plan(tmp_path / "plan.json", MIXED)
    assert main(["info", llama4, "--kv-cache-plan", plan, "--kv-cache-dtype", "fp8", "--kv-cache-memory", "1MiB",
                 "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert f"KV plan      {plan}: 3 pools; layers it does not name: fp8_e4m3" in out
    rows = {line.split()[0]: line for line in out.splitlines()[-5:]}
    # 2 KV heads x head_dim 16, K and V: fp8 64 B per layer (2 layers), bf16 128, int4 2 x 2 x (8 + 4) = 48
    assert rows["0"].split()[1:4] == ["fp8_e4m3", "2-3", "128"]
    assert rows["1"].split()[1:4] == ["bfloat16", "0", "128"]
    assert rows["2"].split()[1:6] == ["int4_per_token_head", "+", "hadamard", "1", "48"]
    assert rows["all"].split()[1] == str(128 + 128 + 48)
    assert "tokens keeping every block" in out
