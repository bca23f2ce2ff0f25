"""The weights' quantization when none is given (``EngineArgs.weight_quantization``, ``default_quantization``): a
quantized GGUF file keeps its blocks on the CPU in bfloat16 with kv8's kernels and one rank; everything else runs the
weights as loaded; ``quantization="none"`` always does."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kv8.engine.args import EngineArgs, default_quantization
from kv8.loader.model import keeps_gguf_blocks, read_model_config
from kv8.platform import CPU
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.kernels import dense_kernels_or_reason

# what an unset quantization gives a quantized GGUF file here: its blocks where kv8's dense kernels load
KEPT = "gguf" if dense_kernels_or_reason()[0] is not None else None

F16_ONLY = {name: QT.F16 for name in ("token_embd.weight", "output.weight", "attn_q.weight", "attn_k.weight",
                                      "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
                                      "ffn_down.weight")}


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "q8.gguf"
    write_tiny_gguf(path, bpe=True, hidden=64, inter=128, types={"attn_k.weight": QT.Q8_0})
    return str(path)


@pytest.fixture(scope="module")
def f16_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "f16.gguf"
    write_tiny_gguf(path, bpe=True, hidden=64, inter=128, types=F16_ONLY)
    return str(path)


def test_a_file_keeps_blocks_when_a_decoder_weight_has_a_kept_type(q8_file: str, f16_file: str) -> None:
    assert keeps_gguf_blocks("gguf", q8_file)
    assert not keeps_gguf_blocks("gguf", f16_file)   # F16 / F32 tensors only: nothing to keep
    assert not keeps_gguf_blocks("hf", q8_file)


def test_unset_means_gguf_for_a_quantized_file_and_none_dequantizes(q8_file: str) -> None:
    assert EngineArgs(model=q8_file).weight_quantization("gguf", q8_file) == (KEPT, KEPT is not None)
    assert EngineArgs(model=q8_file, quantization="none").weight_quantization("gguf", q8_file) == (None, False)
    assert EngineArgs(model=q8_file, quantization="gguf").weight_quantization("gguf", q8_file) == ("gguf", False)
    assert EngineArgs(model=q8_file, quantization="fp8").weight_quantization("gguf", q8_file) == ("fp8", False)
    hf_config = read_model_config("gguf", q8_file)
    config = EngineArgs(model=q8_file, num_kv_blocks=8, max_model_len=64).create_engine_config(hf_config, "gguf",
                                                                                                q8_file)
    assert (config.quantization, config.quantization_auto) == (KEPT, KEPT is not None)


@pytest.mark.parametrize("change", [
    {"dtype": torch.float32},              # the kernels take bfloat16 rows
    {"dense_backend": "torch"},            # no kernel: the blocks would be dequantized at every call
    {"load_format": "dummy"},              # random weights: no blocks
    {"tensor_parallel_size": 2},           # asked for by name under tensor parallelism
    {"model_kind": "hf"},
])
def test_the_weights_stay_as_loaded_outside_the_kernels_reach(q8_file: str, change: dict) -> None:
    given = {"model_kind": "gguf", "model_path": q8_file, "dtype": torch.bfloat16, "platform": CPU,
             "dense_backend": "auto", "load_format": "auto", "tensor_parallel_size": 1}
    assert default_quantization(**given) == KEPT
    assert default_quantization(**(given | change)) is None


def test_a_file_without_blocks_of_a_kept_type_stays_as_loaded(f16_file: str) -> None:
    assert EngineArgs(model=f16_file).weight_quantization("gguf", f16_file) == (None, False)


def test_a_bad_value_names_the_field_and_the_choices(q8_file: str) -> None:
    with pytest.raises(ValueError, match=r"quantization='int3'.*fp8, gguf, none"):
        EngineArgs(model=q8_file, quantization="int3").weight_quantization("gguf", q8_file)


def test_an_engine_of_a_quantized_file_runs_its_blocks_by_default(q8_file: str) -> None:
    from kv8 import LLM, SamplingParams
    from kv8.layers.linear import LinearBase

    def methods(**options: object) -> set[str]:
        llm = LLM(q8_file, kv_cache_memory="8MiB", max_model_len=64, **options)
        assert llm.generate([[1, 5, 7]], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids
        return {m.method.name for m in llm.engine.model.modules() if isinstance(m, LinearBase)}

    assert ("gguf" in methods()) == (KEPT is not None)
    assert "gguf" not in methods(quantization="none")
