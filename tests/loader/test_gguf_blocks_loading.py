"""``quantization="gguf"``: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K blocks kept as they are by the loader and
the linear layers (kv8.loader.gguf, kv8.loader.model, kv8.layers.linear.GGUFLinearMethod), the option's checks, and
engines on a tiny GGUF model. Oracles: the HF tensors the tiny file was written from (tests/helpers/gguf_files.py),
the file's own tensor bytes, and the same engine with the blocks dequantized to bf16 (``quantization`` unset)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kv8 import LLM, SamplingParams
from kv8.engine.args import EngineArgs
from kv8.layers.linear import GGUFLinearMethod, LinearBase
from kv8.loader.gguf import read_gguf
from kv8.loader.model import describe_weights, load_model, read_model_config
from kv8.loader.sources import default_model_path
from kv8.quant.gguf_blocks import dequantize_blocks
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.kernels import dense_kernels_or_reason

LINEAR = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
          "ffn_down.weight")
# hidden 64 and intermediate 96: every K a multiple of 32; Q4_K's super-blocks need multiples of 256
SIZES = dict(hidden=64, heads=2, kv_heads=1, inter=96, vocab=48)
SIZES_256 = dict(hidden=256, heads=2, kv_heads=1, inter=256, vocab=48)
_KERNELS, _ = dense_kernels_or_reason()


def _sizes(qtype: QT) -> dict[str, int]:
    return SIZES_256 if qtype == QT.Q4_K else SIZES


def _tiny(path: Path, qtype: QT, arch: str = "llama", **types: QT) -> dict[str, torch.Tensor]:
    """A tiny model whose tensors have std 0.4 (norms too): logits a few nats apart; all K multiples of 256 where any
    tensor is Q4_K, with std 0.2 (four times the width: std 0.4 moved the log-probabilities 0.43 nats with Q4_1 or
    Q4_K blocks kept, and the greedy tokens with Q4_K; 0.2 moves them 0.02, as 0.4 does at hidden 64)."""
    all_types = dict.fromkeys(LINEAR, qtype) | {"token_embd.weight": QT.F32} | types
    wide = QT.Q4_K in all_types.values()
    return write_tiny_gguf(path, arch, types=all_types, bpe=True, scale=0.2 if wide else 0.4,   # type: ignore[arg-type]
                           **(SIZES_256 if wide else SIZES))


def _linear_layers(model: torch.nn.Module) -> dict[str, LinearBase]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q4_K])
def test_layers_keep_the_files_blocks(tmp_path: Path, qtype: QT, arch: str) -> None:
    """Each decoder layer holds exactly the file's bytes of its tensors (no bf16 copy), which dequantize to the
    written weights in HF row order (llama: q/k rows put back; merged q/k/v and gate/up in shard order); the LM head
    keeps the compute dtype."""
    path = tmp_path / "m.gguf"
    expected = _tiny(path, qtype, arch)
    loaded = load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")
    _, reader = read_gguf(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.name.split(".", 2)[-1] in LINEAR)
    layers = _linear_layers(loaded.model)
    kept = {name: m for name, m in layers.items() if isinstance(m.method, GGUFLinearMethod)}
    assert len(kept) == 4 * 2 and all(name.startswith("model.layers.") for name in kept)
    assert sum(m.gguf_blocks.numel() for m in kept.values()) == file_bytes
    for m in kept.values():
        assert m.gguf_blocks.dtype == torch.uint8 and m.gguf_qtype == qtype.name
        assert m.gguf_grouped == (_KERNELS is not None)   # the kernel's order where it runs
        assert not hasattr(m, "weight") and not any(p.numel() for p in m.parameters())
    assert {m.method.name for name, m in layers.items() if name not in kept} <= {"packed_bf16", "torch", "torch_fp32"}
    p = "model.layers.1."
    hidden, inter = _sizes(qtype)["hidden"], _sizes(qtype)["inter"]
    qkv = kept[p + "self_attn.qkv_proj"]
    want = torch.cat([expected[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(dequantize_blocks(GGUFLinearMethod.file_blocks(qkv), qtype.name, hidden), want)
    gate_up = kept[p + "mlp.gate_up_proj"]
    want = torch.cat([expected[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
    assert torch.equal(dequantize_blocks(GGUFLinearMethod.file_blocks(gate_up), qtype.name, hidden), want)
    down = kept[p + "mlp.down_proj"]
    want = expected[p + "mlp.down_proj.weight"]
    assert torch.equal(dequantize_blocks(GGUFLinearMethod.file_blocks(down), qtype.name, inter), want)


PROMPT = [1, 5, 7, 9, 11, 13, 3, 17, 19, 21, 23, 25]


def _run(path: Path, **options: object) -> tuple[list[int], torch.Tensor, set[str]]:
    llm = LLM(str(path), kv_cache_memory="8MiB", max_model_len=128, **options)
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    logprobs = torch.tensor([p[t].logprob for t, p in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])])
    methods = {m.method.name for m in llm.engine.model.modules() if isinstance(m, LinearBase)}
    llm.close()
    return list(out.outputs[0].token_ids), logprobs, methods


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.Q4_K])
def test_engine_with_kept_blocks_matches_the_dequantized_model(tmp_path: Path, qtype: QT) -> None:
    """The same file, blocks kept vs dequantized to bf16: the same greedy tokens, and prompt log-probabilities within
    the int8 activations' rounding (measured on the AMD EPYC: 0.056 nats for Q8_0, 0.037 for Q4_1, on
    log-probabilities of -2.5 to -5.5; the bound asserted is 0.15). The torch path
    (the reference method, float32 on the dequantized blocks) agrees too."""
    path = tmp_path / "m.gguf"
    _tiny(path, qtype)
    tokens, logprobs, methods = _run(path)
    kept_tokens, kept_logprobs, kept_methods = _run(path, quantization="gguf")
    assert "gguf" in kept_methods and "gguf" not in methods
    assert kept_tokens == tokens
    assert (kept_logprobs - logprobs).abs().max().item() < 0.15
    ref_tokens, ref_logprobs, ref_methods = _run(path, quantization="gguf", dense_backend="torch")
    assert "gguf" in ref_methods and ref_tokens == tokens
    assert (ref_logprobs - logprobs).abs().max().item() < 0.15


def test_unsupported_block_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _tiny(path, QT.Q4_0, **{"ffn_down.weight": QT.Q5_1})
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk.0.ffn_down.weight' \(model.layers.0.mlp.down_proj.weight\) "
                                         r"has type Q5_1; quantization='gguf' keeps \['Q8_0', 'Q4_0', 'Q4_1', 'Q5_0', "
                                         r"'Q4_K'\] blocks"):
        load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")


def test_merged_tensors_of_different_types_are_named(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _tiny(path, QT.Q4_0, **{"attn_k.weight": QT.Q8_0})
    with pytest.raises(ValueError, match=r"different block types \(blk.0.attn_q.weight \(Q4_0\), blk.0.attn_k.weight "
                                         r"\(Q8_0\), blk.0.attn_v.weight \(Q4_0\)\)"):
        load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")


def test_the_option_is_checked_at_the_boundary(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _tiny(path, QT.Q4_1)
    hf = read_model_config("gguf", str(path))
    assert EngineArgs(quantization="gguf").create_engine_config(hf, "gguf", str(path)).quantization == "gguf"
    with pytest.raises(ValueError, match=r"quantization='gguf' keeps the blocks of a GGUF file, but model=.* is a hf "
                                         "checkpoint"):
        EngineArgs(quantization="gguf").create_engine_config(hf, "hf", str(tmp_path))
    with pytest.raises(ValueError, match=r"load_format='dummy' reads none: use load_format='auto'"):
        EngineArgs(quantization="gguf", load_format="dummy").create_engine_config(hf, "gguf", str(path))
    with pytest.raises(ValueError, match=r"runs on one rank .*tensor_parallel_size=2: use 1"):
        EngineArgs(quantization="gguf", tensor_parallel_size=2).create_engine_config(hf, "gguf", str(path))
    with pytest.raises(ValueError, match=r"quantization='int4' is not supported; choose one of: fp8, gguf"):
        EngineArgs(quantization="int4").create_engine_config(hf, "gguf", str(path))


@pytest.mark.skipif(_KERNELS is None, reason="kv8's dense kernels are unavailable")
def test_smollm2_linear_layers_hold_the_files_bytes() -> None:
    """The default model (Q4_1): the decoder's linear layers hold the file's bytes of those tensors, a third of their
    bf16 size, and the layers run the kernel."""
    path = default_model_path()
    loaded = load_model("gguf", path, torch.bfloat16, "packed_bf16", quantization="gguf")
    _, reader = read_gguf(path)
    linear = [t for t in reader.tensors if t.name.startswith("blk.") and t.name.split(".", 2)[-1] in LINEAR]
    held = [m for m in loaded.model.modules() if isinstance(m, LinearBase) and hasattr(m, "gguf_blocks")]
    assert len(held) == 4 * loaded.arch.num_layers and {m.gguf_qtype for m in held} == {"Q4_1"}
    resident = sum(m.gguf_blocks.numel() for m in held)
    assert resident == sum(int(t.n_bytes) for t in linear)
    assert resident * 3 < 2 * sum(int(t.n_elements) for t in linear)


def test_info_says_how_the_weights_are_held(tmp_path: Path) -> None:
    """``kv8 info``'s weights line: the kept types, tensor counts and bytes; an unsupported type named up front."""
    path = tmp_path / "m.gguf"
    _tiny(path, QT.Q4_1, **{"ffn_down.weight": QT.Q8_0})
    _, reader = read_gguf(str(path))
    q41 = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == QT.Q4_1)
    q80 = sum(int(t.n_bytes) for t in reader.tensors if t.name.endswith("ffn_down.weight"))
    text = describe_weights("gguf", str(path), "gguf")
    assert text.startswith(f"gguf: the file's blocks, not expanded (Q4_1: 12 tensors, {q41 / 2**20:.1f} MiB; "
                           f"Q8_0: 2 tensors, {q80 / 2**20:.1f} MiB)")
    assert describe_weights("gguf", str(path), None).startswith("as loaded")
    bad = tmp_path / "bad.gguf"
    _tiny(bad, QT.Q4_1, **{"attn_v.weight": QT.Q5_1})
    with pytest.raises(ValueError, match=r"'blk.0.attn_v.weight' \(model.layers.0.self_attn.v_proj.weight\) has type "
                                         r"Q5_1"):
        describe_weights("gguf", str(bad), "gguf")


SMOLLM2_TEXT = ("The river rises in the northern hills and flows south through a wide valley of farms and small "
                "towns. In the nineteenth century a canal was built beside it, and the towns grew as boats carried "
                "grain, coal and timber to the coast. Today the canal is used mostly by visitors, and the old "
                "warehouses along its banks have become museums, shops and homes.")


@pytest.mark.slow
def test_smollm2_with_kept_blocks_stays_close_to_its_dequantized_weights() -> None:
    """The default model's Q4_1 blocks kept vs dequantized to bf16 (the same weights; only the kernel's int8
    activations and bf16 path differ): over an English paragraph the mean log-likelihood moves by < 0.05 nats, the
    top token agrees at >= 90% of positions, and greedy decoding still answers the capital question."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    runs = {}
    for q in (None, "gguf"):
        llm = LLM(model="smollm2-135m", quantization=q, kv_cache_memory="64MiB", max_model_len=512)
        runs[q] = llm.generate(SMOLLM2_TEXT, params)[0]
        if q == "gguf":
            text = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
            assert "Paris" in text.outputs[0].text, text.outputs[0].text
            names = {m.method.name for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)}
            assert "gguf" in names and len(names) == 2, names   # the decoder's, and the head
        llm.close()
    ids = runs[None].prompt_token_ids
    nll = {q: -sum(p[t].logprob for t, p in zip(ids[1:], r.prompt_logprobs[1:])) / (len(ids) - 1)
           for q, r in runs.items()}
    assert abs(nll["gguf"] - nll[None]) < 0.05, nll
    top = {q: [max(p.items(), key=lambda kv: kv[1].logprob)[0] for p in r.prompt_logprobs[1:]] for q, r in runs.items()}
    agree = sum(a == b for a, b in zip(top[None], top["gguf"])) / len(top[None])
    assert agree >= 0.9, agree
