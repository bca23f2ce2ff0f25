"""Keys and values rotated apart (``kv_cache_rotation="none/hadamard"``, ``"hadamard/none"``): the option's values,
the codec's two bases, what the attention layer stores for each side, exactness of attention over a 32-bit cache,
the per-side rotation in a plan file and in static scales.

Model: a 4-layer variant of the tiny ``llama_gqa`` (head_dim 16) from tests/helpers/tiny_models.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from kv8 import SamplingParams
from kv8.cache.codec import K, KVCodec, V
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.observer import EngineObserver
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.rotation import canonical_rotation, hadamard, is_rotated, rotation_sides
from kv8.quant.scales import KVScales
from tests.helpers.engine import PROMPTS, assert_greedy_match, make_llm
from tests.helpers.tiny_models import make_tiny_model

GREEDY_LP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("llama4")), "llama_gqa", num_hidden_layers=4)


@pytest.mark.parametrize("value,sides,canonical", [
    ("none", ("none", "none"), "none"), ("hadamard", ("hadamard", "hadamard"), "hadamard"),
    ("none/hadamard", ("none", "hadamard"), "none/hadamard"), ("hadamard/none", ("hadamard", "none"), "hadamard/none"),
    ("hadamard/hadamard", ("hadamard", "hadamard"), "hadamard"), ("none/none", ("none", "none"), "none"),
])
def test_rotation_values(value, sides, canonical):
    assert rotation_sides(value) == sides
    assert canonical_rotation(value) == canonical
    assert is_rotated(value) == (sides != ("none", "none"))


def test_an_eval_configuration_built_directly_keeps_the_canonical_rotation():
    from kv8.tools.evaluate import KVConfig

    both = KVConfig("int8", kv_cache_rotation="hadamard/hadamard")
    assert both.kv_cache_rotation == "hadamard" and both.label == "int8+hadamard"
    assert both == KVConfig.from_flags("--kv-cache-dtype int8 --kv-cache-rotation hadamard")
    assert KVConfig("int8", kv_cache_rotation="none/none").label == "int8"
    with pytest.raises(ValueError, match=r"kv_cache_rotation='givens' is not supported"):
        KVConfig("int8", kv_cache_rotation="givens")


@pytest.mark.parametrize("bad", ["", "/", "hadamard/", "/none", "givens", "none/givens", "none/none/none",
                                 "Hadamard", None, 3])
def test_bad_rotation_values_name_the_field_the_value_and_what_is_allowed(bad):
    with pytest.raises(ValueError, match=rf"my_field={bad!r} is not supported; choose none, hadamard, or keys/values "
                                         r"apart such as none/hadamard \(each side one of: none, hadamard\)"):
        rotation_sides(bad, "my_field")


@pytest.mark.parametrize("rotation", ["none/hadamard", "hadamard/none"])
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3/int4_per_group32", "float32"])
def test_the_codec_keeps_a_basis_per_side(rotation, kv):
    k_side, v_side = rotation_sides(rotation)
    k_dtype = resolve_kv_cache_dtype(kv.split("/")[0], torch.float32)
    v_dtype = resolve_kv_cache_dtype(kv.split("/")[-1], torch.float32)
    codec = KVCodec.build(k_dtype, 32, rotation=rotation, v_dtype=v_dtype,
                          scale_mode="dynamic" if k_dtype.is_fp8 else "static")
    assert codec.rotation_name == rotation
    x = torch.randn(5, 2, 32)
    for which, side in ((K, k_side), (V, v_side)):
        expected = x @ hadamard(32) if side == "hadamard" else x
        torch.testing.assert_close(codec.to_stored_basis(x, which), expected, rtol=0, atol=0)
    torch.testing.assert_close(codec.queries_to_stored(x, 0), codec.to_stored_basis(x, K), rtol=0, atol=0)
    torch.testing.assert_close(codec.keys_to_stored(x, 0), codec.to_stored_basis(x, K), rtol=0, atol=0)
    moved = codec.to("cpu")
    assert (moved.rotation is None) == (k_side == "none") and (moved.v_rotation is None) == (v_side == "none")


class _Stored(EngineObserver):
    """Layer 0's K/V as the layer hands them to the cache (the codec's stored basis), from the prompt's step."""

    def __init__(self) -> None:
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def on_kv_store(self, layer, key, value, codec) -> None:
        if layer == 0 and self.kv is None:
            self.kv = (key.clone(), value.clone())


def _stored(path: str, rotation: str, kv_dtype: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    observer = _Stored()
    engine = LLMEngine(EngineArgs(model=path, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
                                  kv_cache_dtype=kv_dtype, kv_cache_rotation=rotation), observer)
    assert engine.cache.codec.rotation_name == canonical_rotation(rotation)
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), "r")
    while engine.has_unfinished_requests():
        engine.step()
    assert observer.kv is not None
    return observer.kv


def test_each_side_is_stored_in_its_own_basis(llama4):
    """Layer 0's new K/V do not depend on the cache: with "none/hadamard" the keys reach the cache as an unrotated
    cache's do and the values as a rotated cache's do, and the other way round with "hadamard/none"."""
    plain, rotated = _stored(llama4, "none"), _stored(llama4, "hadamard")
    assert not torch.equal(plain[K], rotated[K]) and not torch.equal(plain[V], rotated[V])
    for rotation, k_from, v_from in (("none/hadamard", plain, rotated), ("hadamard/none", rotated, plain)):
        k, v = _stored(llama4, rotation)
        assert torch.equal(k, k_from[K]) and torch.equal(v, v_from[V]), rotation


@pytest.mark.parametrize("rotation", ["none/hadamard", "hadamard/none"])
def test_attention_over_a_32_bit_cache_is_unchanged_by_either_side(llama4, rotation):
    """Rotating one side is exact in exact arithmetic (module docstring of kv8.quant.rotation): over a float32 cache
    the greedy tokens and their logprobs equal the unrotated cache's within float32 rounding."""
    prompts = PROMPTS[:3]
    expected = [o.outputs[0] for o in make_llm(llama4, dtype="float32", kv_cache_dtype="float32")
                .generate(prompts, GREEDY_LP)]
    got = make_llm(llama4, dtype="float32", kv_cache_dtype="float32", kv_cache_rotation=rotation
                   ).generate(prompts, GREEDY_LP)
    assert_greedy_match([o.outputs[0] for o in got], expected)


def test_a_plan_file_rotates_one_side_of_a_layer(llama4, tmp_path):
    """A plan entry's kv_cache_rotation may be a K/V pair: that layer's pool stores its values rotated, its keys
    not, and the spelling is canonical ("hadamard/hadamard" is "hadamard")."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {
        "1": {"kv_cache_dtype": "int8", "kv_cache_rotation": "none/hadamard"},
        "2": {"kv_cache_dtype": "int8", "kv_cache_rotation": "hadamard/hadamard"}}}))
    llm = make_llm(llama4, dtype="float32", kv_cache_dtype="fp8_e4m3", kv_cache_plan=str(plan))
    pools = sorted((c.kv_dtype.name, c.codec.rotation_name, sorted(c.slots)) for c in llm.engine.caches)
    assert pools == [("fp8_e4m3", "none", [0, 3]), ("int8_per_token_head", "hadamard", [2]),
                     ("int8_per_token_head", "none/hadamard", [1])]
    one_side = next(c.codec for c in llm.engine.caches if c.codec.rotation_name == "none/hadamard")
    assert one_side.rotation is None and one_side.v_rotation is not None
    out = llm.generate(PROMPTS[:2], GREEDY_LP)
    assert all(len(o.outputs[0].token_ids) == GREEDY_LP.max_tokens for o in out)


def test_static_scales_name_the_basis_of_each_side(llama4, tmp_path):
    """Static FP8 scales record the rotation they were calibrated in, per side; a cache in another basis refuses them
    and names both."""
    scales = KVScales(torch.ones(4, 1, 1), torch.ones(4, 1, 1), KVScales.default(4).granularity, "test", None,
                      rotation="hadamard/hadamard")
    assert scales.rotation == "hadamard"
    with pytest.raises(ValueError, match=r"KVScales.rotation='none/rotated' is not supported"):
        KVScales(torch.ones(4, 1, 1), torch.ones(4, 1, 1), scales.granularity, "test", None, rotation="none/rotated")
    from kv8.quant.scale_files import write_kv8_scales_json
    from kv8.quant.scales import ModelScaleInfo
    path = str(tmp_path / "scales.json")
    info = ModelScaleInfo("llama", 4, 2, 16)
    write_kv8_scales_json(path, KVScales(torch.ones(4, 1, 1), torch.ones(4, 1, 1), scales.granularity, "test", None,
                                         rotation="none/hadamard"), info)
    make_llm(llama4, kv_cache_dtype="fp8_e4m3", kv_cache_rotation="none/hadamard", quantization_param_path=path)
    with pytest.raises(ValueError, match=r"calibrated with rotation 'none/hadamard', but "
                                         r"kv_cache_rotation='hadamard/none'"):
        make_llm(llama4, kv_cache_dtype="fp8_e4m3", kv_cache_rotation="hadamard/none", quantization_param_path=path)
