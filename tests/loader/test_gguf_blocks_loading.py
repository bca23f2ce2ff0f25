"""``quantization="gguf"``: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K / Q6_K blocks kept as they are by the loader
and the linear layers (kv8.loader.gguf, kv8.loader.model, kv8.layers.linear.GGUFLinearMethod), the option's checks, and
engines on a tiny GGUF model. Oracles: the HF tensors the tiny file was written from (tests/helpers/gguf_files.py),
the file's own tensor bytes, and the same engine with the blocks dequantized to bf16 (``quantization`` unset)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kv8 import LLM, SamplingParams
from kv8.engine.args import EngineArgs
from kv8.layers.linear import GGUFLinearMethod, LinearBase
from kv8.loader.gguf import read_gguf
from kv8.loader.model import (
    describe_gguf_blocks,
    describe_weights,
    load_model,
    read_model_config,
    resident_weight_bytes,
)
from kv8.loader.sources import default_model_path
from kv8.quant.gguf_blocks import dequantize_blocks, gguf_activation_bound
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.kernels import dense_kernels_or_reason, gguf_path

LINEAR = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
          "ffn_down.weight")
# hidden 64 and intermediate 96: every K a multiple of 32; Q4_K's and Q6_K's super-blocks need multiples of 256
SIZES = dict(hidden=64, heads=2, kv_heads=1, inter=96, vocab=48)
SIZES_256 = dict(hidden=256, heads=2, kv_heads=1, inter=256, vocab=48)
_KERNELS, _ = dense_kernels_or_reason()


K_QUANTS = (QT.Q4_K, QT.Q6_K)


def _sizes(qtype: QT) -> dict[str, int]:
    return SIZES_256 if qtype in K_QUANTS else SIZES


def _tiny(path: Path, qtype: QT, arch: str = "llama", **types: QT) -> dict[str, torch.Tensor]:
    """A tiny model whose tensors have std 0.4 (norms too): logits a few nats apart; all K multiples of 256 where any
    tensor is a K-quant (Q4_K, Q6_K), with std 0.2 (four times the width: std 0.4 moved the log-probabilities 0.43
    nats with Q4_1 or Q4_K blocks kept, and the greedy tokens with Q4_K; 0.2 moves them 0.02, as 0.4 does at hidden
    64)."""
    all_types = dict.fromkeys(LINEAR, qtype) | {"token_embd.weight": QT.F32} | types
    wide = any(t in K_QUANTS for t in all_types.values())
    return write_tiny_gguf(path, arch, types=all_types, bpe=True, scale=0.2 if wide else 0.4,   # type: ignore[arg-type]
                           **(SIZES_256 if wide else SIZES))


def _linear_layers(model: torch.nn.Module) -> dict[str, LinearBase]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q6_K])
def test_layers_keep_the_files_blocks(tmp_path: Path, qtype: QT, arch: str) -> None:
    """Each decoder layer holds exactly the file's bytes of its tensors (no bf16 copy), which dequantize to the
    written weights in HF row order (llama: q/k rows put back; merged q/k/v and gate/up in shard order); the LM head,
    tied to an F32 embedding (no kernel reads F32), holds that table dequantized to the compute dtype."""
    path = tmp_path / "m.gguf"
    expected = _tiny(path, qtype, arch)
    loaded = load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")
    _, reader = read_gguf(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.name.split(".", 2)[-1] in LINEAR)
    layers = _linear_layers(loaded.model)
    kept = {name: m for name, m in layers.items() if name.startswith("model.layers.")}
    assert len(kept) == 4 * 2 and all(isinstance(m.method, GGUFLinearMethod) for m in kept.values())
    segments = [s for m in kept.values() for s in m.gguf_segments]
    assert len(segments) == len(kept) and sum(s.nbytes() for s in segments) == file_bytes   # one segment a layer
    for s in segments:
        assert s.blocks.dtype == torch.uint8 and s.qtype == qtype.name and not s.expanded
        assert s.grouped == (_KERNELS is not None)   # the kernel's order where it runs
    for m in kept.values():
        assert not hasattr(m, "weight") and not any(p.numel() for p in m.parameters())
    head = layers["lm_head"]
    assert isinstance(head.method, GGUFLinearMethod)
    assert [(s.qtype, s.expanded) for s in head.gguf_segments] == [("F32", True)]
    assert loaded.model.model.embed_tokens.gguf_rows is None   # F32: the dequantized table, as without the option
    p = "model.layers.1."
    hidden, inter = _sizes(qtype)["hidden"], _sizes(qtype)["inter"]
    qkv = kept[p + "self_attn.qkv_proj"]
    want = torch.cat([expected[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(dequantize_blocks(qkv.gguf_segments[0].file_blocks(), qtype.name, hidden), want)
    gate_up = kept[p + "mlp.gate_up_proj"]
    want = torch.cat([expected[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
    assert torch.equal(dequantize_blocks(gate_up.gguf_segments[0].file_blocks(), qtype.name, hidden), want)
    down = kept[p + "mlp.down_proj"]
    want = expected[p + "mlp.down_proj.weight"]
    assert torch.equal(dequantize_blocks(down.gguf_segments[0].file_blocks(), qtype.name, inter), want)


PROMPT = [1, 5, 7, 9, 11, 13, 3, 17, 19, 21, 23, 25]


def _run(path: Path, **options: object) -> tuple[list[int], torch.Tensor, set[str]]:
    """Greedy tokens (cut before the first whose top-two log-probabilities lie within TIE of each other: there the
    kernels' rounding may pick either), prompt log-probabilities, and the linear methods used."""
    llm = LLM(str(path), kv_cache_memory="8MiB", max_model_len=128, **options)
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, logprobs=2, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    logprobs = torch.tensor([p[t].logprob for t, p in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])])
    methods = {m.method.name for m in llm.engine.model.modules() if isinstance(m, LinearBase)}
    llm.close()
    tokens = []
    for token, top in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        first, second = sorted((lp.logprob for lp in top.values()), reverse=True)[:2]
        if first - second < TIE:
            break
        tokens.append(token)
    return tokens, logprobs, methods


TIE = 0.15   # the log-probability error the int8 activations may make (below)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.Q6_K])
def test_engine_with_kept_blocks_matches_the_dequantized_model(tmp_path: Path, qtype: QT) -> None:
    """The same file, blocks kept vs dequantized to bf16: the same greedy tokens (up to the first near-tie of either
    run), and prompt log-probabilities within
    the int8 activations' rounding (measured on the AMD EPYC: 0.056 nats for Q8_0, 0.037 for Q4_1, on
    log-probabilities of -2.5 to -5.5; the bound asserted is 0.15). The torch path
    (the reference method, float32 on the dequantized blocks) agrees too."""
    path = tmp_path / "m.gguf"
    _tiny(path, qtype)
    tokens, logprobs, methods = _run(path, quantization="none")
    assert tokens   # (the first greedy token is no near-tie: the comparison below is not empty)
    kept_tokens, kept_logprobs, kept_methods = _run(path, quantization="gguf")
    assert "gguf" in kept_methods and "gguf" not in methods
    n = min(len(tokens), len(kept_tokens))
    assert kept_tokens[:n] == tokens[:n]
    assert (kept_logprobs - logprobs).abs().max().item() < TIE
    ref_tokens, ref_logprobs, ref_methods = _run(path, quantization="gguf", dense_backend="torch")
    n = min(len(tokens), len(ref_tokens))
    assert "gguf" in ref_methods and ref_tokens[:n] == tokens[:n]
    assert (ref_logprobs - logprobs).abs().max().item() < TIE


@pytest.mark.skipif(_KERNELS is None or len(_KERNELS.gguf_paths) < 2, reason="fewer than two GGUF kernel paths here")
def test_engine_on_every_gguf_kernel_path_gives_the_same_bits(tmp_path: Path) -> None:
    """An engine on each path of the GGUF int8 kernel (DenseKernels.gguf_path, set before the engine is built: its CPU
    graphs record the path): the same greedy tokens and prompt log-probabilities, bit for bit (the paths compute the
    same integer dot products and float32 operations)."""
    assert _KERNELS is not None
    path = tmp_path / "m.gguf"
    _tiny(path, QT.Q4_1)
    runs = {}
    for kernel_path in _KERNELS.gguf_paths:
        with gguf_path(_KERNELS, kernel_path):
            runs[kernel_path] = _run(path, quantization="gguf")
    (tokens, logprobs, methods), *others = runs.values()
    assert "gguf" in methods
    for other_tokens, other_logprobs, _ in others:
        assert other_tokens == tokens and torch.equal(other_logprobs, logprobs)


MIXED = {"attn_k.weight": QT.Q8_0, "attn_v.weight": QT.Q5_1, "ffn_down.weight": QT.Q5_1}   # in a Q4_0 file


def test_a_type_without_a_kernel_is_dequantized_alone_with_one_warning(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Q5_1 tensors (no kernel) in a Q4_0 file with a Q8_0 k_proj: those tensors alone come dequantized to bf16, with
    one warning naming them and what stays blocks; q/k/v holds three segments (Q4_0 q, Q8_0 k, bf16 v) and each
    multiplies as its reference does; ``describe_gguf_blocks`` lists both kinds."""
    path = tmp_path / "m.gguf"
    expected = _tiny(path, QT.Q4_0, **MIXED)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        loaded = load_model("gguf", str(path), torch.bfloat16, "auto", quantization="gguf")
    warned = [r.getMessage() for r in caplog.records if "without a kv8 kernel" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "quantization='gguf': 4 of the 14 decoder weight tensors have a type without a kv8 kernel (Q5_1: 4; "
        "blk.0.attn_v.weight, blk.0.ffn_down.weight, blk.1.attn_v.weight, ...); each is dequantized alone to bfloat16")
    assert warned[0].endswith("the other 10 stay as the file's blocks (Q4_0: 8, Q8_0: 2)")
    p = "model.layers.1."
    qkv = loaded.model.get_submodule(p + "self_attn.qkv_proj")
    down = loaded.model.get_submodule(p + "mlp.down_proj")
    assert [(s.qtype, s.expanded, s.rows) for s in qkv.gguf_segments] == [("Q4_0", False, 64), ("Q8_0", False, 32),
                                                                         ("Q5_1", True, 32)]
    assert [(s.qtype, s.expanded, s.rows) for s in down.gguf_segments] == [("Q5_1", True, 64)]
    assert not hasattr(down, "weight") and not hasattr(qkv, "weight")
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    y = qkv(x).double()
    blocks = [s.file_blocks() for s in qkv.gguf_segments[:2]]
    w = torch.cat([dequantize_blocks(blocks[0], "Q4_0", 64), dequantize_blocks(blocks[1], "Q8_0", 64),
                   expected[p + "self_attn.v_proj.weight"].bfloat16().float()])
    exact = x.double() @ w.double().T
    slack = 2.0 ** -8 * exact.abs() * 1.01 + 1e-5 * (x.double().abs() @ w.double().abs().T)
    bound = torch.cat([gguf_activation_bound(x, blocks[0], "Q4_0"), gguf_activation_bound(x, blocks[1], "Q8_0"),
                       torch.zeros(3, 32, dtype=torch.float64)], dim=1)   # the bf16 rows: no activation rounding
    if _KERNELS is None:
        bound = torch.zeros_like(bound)   # the reference: float32 on the dequantized blocks
    assert bool(((y - exact).abs() <= bound + slack).all())
    text = describe_gguf_blocks(loaded.model)
    assert text.startswith("Q4_0: 8 tensors, Q8_0: 2 tensors as blocks, ")
    assert "; dequantized at load: Q5_1: 4 tensors, " in text


def test_engine_with_mixed_and_expanded_types_matches_the_dequantized_model(tmp_path: Path) -> None:
    """The same mixed file with blocks kept (three segments in q/k/v, bf16 down_proj) and fully dequantized: the
    same greedy tokens, log-probabilities within the int8 activations' rounding."""
    path = tmp_path / "m.gguf"
    _tiny(path, QT.Q4_0, **MIXED)
    tokens, logprobs, _ = _run(path, quantization="none")
    kept_tokens, kept_logprobs, kept_methods = _run(path, quantization="gguf")
    n = min(len(tokens), len(kept_tokens))
    assert "gguf" in kept_methods and n > 0 and kept_tokens[:n] == tokens[:n]
    assert (kept_logprobs - logprobs).abs().max().item() < TIE


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
    tp2 = EngineArgs(quantization="gguf", tensor_parallel_size=2).create_engine_config(hf, "gguf", str(path))
    assert tp2.quantization == "gguf" and tp2.parallel.tensor_parallel_size == 2   # the ranks split the blocks
    with pytest.raises(ValueError, match=r"quantization='int4' is not supported; choose one of: fp8, gguf"):
        EngineArgs(quantization="int4").create_engine_config(hf, "gguf", str(path))


@pytest.mark.skipif(_KERNELS is None, reason="kv8's dense kernels are unavailable")
def test_smollm2_linear_layers_hold_the_files_bytes() -> None:
    """The default model (Q4_1): the decoder's linear layers hold the file's bytes of those tensors, a third of their
    bf16 size, and the layers run the kernel (the embedding and LM head:
    tests/loader/test_gguf_lm_head_embedding.py)."""
    path = default_model_path()
    loaded = load_model("gguf", path, torch.bfloat16, "packed_bf16", quantization="gguf")
    _, reader = read_gguf(path)
    linear = [t for t in reader.tensors if t.name.startswith("blk.") and t.name.split(".", 2)[-1] in LINEAR]
    held = [m for name, m in loaded.model.named_modules() if name.startswith("model.layers.")
            and isinstance(m, LinearBase) and hasattr(m, "gguf_segments")]
    segments = [s for m in held for s in m.gguf_segments]
    assert len(held) == 4 * loaded.arch.num_layers and {(s.qtype, s.expanded) for s in segments} == {("Q4_1", False)}
    resident = sum(s.nbytes() for s in segments)
    assert resident == sum(int(t.n_bytes) for t in linear)
    assert resident * 3 < 2 * sum(int(t.n_elements) for t in linear)


def test_info_says_how_the_weights_are_held(tmp_path: Path) -> None:
    """``kv8 info``'s weights line: the kept types, tensor counts and bytes, then the types dequantized at load."""
    path = tmp_path / "m.gguf"
    _tiny(path, QT.Q4_1, **{"ffn_down.weight": QT.Q8_0})
    _, reader = read_gguf(str(path))
    q41 = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == QT.Q4_1)
    q80 = sum(int(t.n_bytes) for t in reader.tensors if t.name.endswith("ffn_down.weight"))
    text = describe_weights("gguf", str(path), "gguf")
    assert text.startswith(f"gguf: the file's blocks, not expanded (Q4_1: 12 tensors, {q41 / 2**20:.1f} MiB; "
                           f"Q8_0: 2 tensors, {q80 / 2**20:.1f} MiB)")
    assert describe_weights("gguf", str(path), None).startswith("as loaded")
    mixed = tmp_path / "mixed.gguf"
    _tiny(mixed, QT.Q4_1, **{"attn_v.weight": QT.Q5_1})
    _, reader = read_gguf(str(mixed))
    q41 = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == QT.Q4_1)
    q51 = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == QT.Q5_1)
    assert describe_weights("gguf", str(mixed), "gguf").startswith(
        f"gguf: the file's blocks, not expanded (Q4_1: 12 tensors, {q41 / 2**20:.1f} MiB; dequantized at "
        f"load: Q5_1: 2 tensors, {q51 / 2**20:.1f} MiB in the file)")


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
            assert names == {"gguf"}, names   # the decoder's layers and the LM head
        llm.close()
    ids = runs[None].prompt_token_ids
    nll = {q: -sum(p[t].logprob for t, p in zip(ids[1:], r.prompt_logprobs[1:])) / (len(ids) - 1)
           for q, r in runs.items()}
    assert abs(nll["gguf"] - nll[None]) < 0.05, nll
    top = {q: [max(p.items(), key=lambda kv: kv[1].logprob)[0] for p in r.prompt_logprobs[1:]] for q, r in runs.items()}
    agree = sum(a == b for a, b in zip(top[None], top["gguf"])) / len(top[None])
    assert agree >= 0.9, agree


@pytest.mark.slow
def test_gemma3_q4_k_m_keeps_every_decoder_tensor_as_its_blocks() -> None:
    """Gemma-3-270M's Q4_K_M file (Q5_0 q/k/gate/up, Q5_0 or Q8_0 v, Q4_K o and half the down projections, Q6_K the
    other half; a Q8_0 tied embedding of 262,144 rows): every decoder tensor stays as the file's bytes (none is
    dequantized at load), q/k/v mixes Q5_0 and Q8_0 in one layer, the embedding and the LM head share the
    table's Q8_0 blocks, the weights stay within 10% of the file's size; greedy decoding with the kept blocks answers
    as the dequantized weights do."""
    from kv8.loader.sources import gemma3_270m_path

    try:
        path = gemma3_270m_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    loaded = load_model("gguf", path, torch.bfloat16, "auto", quantization="gguf")
    segments = [s for name, m in loaded.model.named_modules() if name.startswith("model.layers.")
                and isinstance(m, LinearBase) and hasattr(m, "gguf_segments") for s in m.gguf_segments]
    table = loaded.model.model.embed_tokens.gguf_rows
    assert table is not None and table.qtype == "Q8_0" and loaded.model.lm_head.gguf_segments[0] is table
    size = os.path.getsize(path)
    assert abs(resident_weight_bytes(loaded.model) - size) <= 0.1 * size
    counts: dict[tuple[str, bool], int] = {}
    for s in segments:
        counts[s.qtype, s.expanded] = counts.get((s.qtype, s.expanded), 0) + s.tensors
    assert counts == {("Q5_0", False): 81, ("Q8_0", False): 9, ("Q4_K", False): 27, ("Q6_K", False): 9}
    _, reader = read_gguf(path)
    linear = [t for t in reader.tensors if t.name.startswith("blk.") and t.name.split(".", 2)[-1] in LINEAR]
    assert sum(s.nbytes() for s in segments) == sum(int(t.n_bytes) for t in linear)
    answers = {}
    for q in (None, "gguf"):
        llm = LLM(model="gemma3-270m", quantization=q, kv_cache_memory="64MiB", max_model_len=256)
        answers[q] = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6))[0]
        llm.close()
    assert answers["gguf"].outputs[0].token_ids == answers[None].outputs[0].token_ids, answers
