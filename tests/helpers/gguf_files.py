"""Tiny synthetic GGUF files written with `gguf.GGUFWriter` as llama.cpp's converter writes them (q/k rows permuted
for llama), returning the Hugging Face tensors a correct reader must produce: the oracle of tests/loader/test_gguf.py
and of the ``quantization="gguf"`` tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from kv8.loader.gguf import hf_tensor_name


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q/k rows: per head, half-split -> interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``w [..., K]`` (K % 256 == 0) -> Q4_K blocks, uint8 ``[..., K / 256 * 144]`` (the ``gguf`` package dequantizes
    Q4_K but does not quantize it). A plain quantizer, not llama.cpp's search: per sub-block of 32, ``min = min(0,
    min w)`` and ``scale = (max w - min) / 15``; the super-block's ``d`` and ``dmin`` (float16) are the largest scale
    and -min over 63, each sub-block's 6-bit ``sc`` and ``m`` the nearest multiples of them, the codes the nearest of
    ``(w + dmin m) / (d sc)`` in 0..15."""
    shape = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)                     # (super-blocks, sub-blocks, 32)
    s = x.shape[0]
    low = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - low) / 15
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmf > 0, np.rint(-low / dmf), 0).clip(0, 63).astype(np.uint8)
        step, offset = df * sc, dmf * m
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(s, 4, 2, 32)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(s, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(s, 2), dmin.view(np.uint8).reshape(s, 2), scales, qs], axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``w [..., K]`` (K % 256 == 0) -> Q6_K blocks, uint8 ``[..., K / 256 * 210]`` (the ``gguf`` package dequantizes
    Q6_K but does not quantize it). A plain quantizer, not llama.cpp's search: per sub-block of 16 the scale ``-v /
    32`` of its value ``v`` of largest magnitude (as llama.cpp's ``make_qx_quants`` starts), the super-block's ``d``
    (float16) the largest |scale| over 127, each sub-block's int8 scale the nearest multiple of it, the codes
    ``rint(w / (d scale)) + 32`` in 0..63; the bytes laid out as ``gguf.quants`` reads them."""
    shape = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)                    # (super-blocks, sub-blocks, 16)
    s = x.shape[0]
    big = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = -big / 32
    d = (np.abs(scale).max(axis=-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.where(step != 0, np.rint(x / step), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(s, 2, 4, 32)   # value 128 h + 32 t + j: (h, t, j)
    ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)               # (s, h, t % 2, j)
    qh = np.zeros_like(q[:, :, 0])                                          # (s, h, j)
    for t in range(4):
        qh |= (q[:, :, t] >> 4) << (2 * t)
    blocks = np.concatenate([ql.reshape(s, 128), qh.reshape(s, 64), sc.view(np.uint8), d.view(np.uint8).reshape(s, 2)],
                            axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 210)


def quantize(array: np.ndarray, qtype: QT) -> np.ndarray:
    """``gguf.quants.quantize``, and :func:`quantize_q4_k` / :func:`quantize_q6_k` for Q4_K / Q6_K."""
    if qtype == QT.Q4_K:
        return quantize_q4_k(array)
    return quantize_q6_k(array) if qtype == QT.Q6_K else gguf.quants.quantize(array, qtype)


def _stored(array: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    """(what to hand GGUFWriter.add_tensor, the float32 values a reader must get back)."""
    if qtype == QT.F32:
        return array.astype(np.float32), array.astype(np.float32)
    if qtype == QT.F16:
        half = array.astype(np.float16)
        return half, half.astype(np.float32)
    blocks = quantize(array, qtype)
    return blocks, gguf.quants.dequantize(blocks, qtype).reshape(array.shape)


def gguf_writer(path: Path, arch: str, layers: int, hidden: int, inter: int, heads: int, kv_heads: int,
            metadata: dict[str, Any] | None) -> Any:
    """A GGUF writer with the shape keys every tiny model has (context 256, RMS eps 1e-6) and ``metadata`` (str,
    list, int or float values, each written with its own GGUF type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    return writer


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    inter: int = 64,
    vocab: int = 32,
    bias: bool = False,
    untied: bool = False,
    types: dict[str, QT] | None = None,
    metadata: dict[str, Any] | None = None,
    skip: tuple[str, ...] = (),
    raw: dict[str, tuple[np.ndarray, QT]] | None = None,
    seed: int = 0,
    bpe: bool = False,
    scale: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Write a random model as llama.cpp would (q/k rows permuted for llama) and return the HF tensors
    (float32) a correct reader must produce. ``types`` maps a GGUF tensor-name suffix (``attn_q.weight``), or a
    whole name (``blk.1.ffn_down.weight``, before its suffix), to its storage type (default: a mix of Q8_0, F16 and
    F32); ``skip`` names GGUF tensors to leave out; ``raw``
    gives ready-made blocks for unpermuted GGUF tensors; ``bpe`` adds a one-merge vocabulary (``a b`` -> ``ab``) that
    transformers can build a tokenizer from (an engine needs one); ``scale`` multiplies every random tensor (standard
    normal otherwise: a model whose logits are far apart)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    default_types = {
        "token_embd.weight": QT.Q8_0, "output.weight": QT.F16, "attn_q.weight": QT.Q8_0, "attn_k.weight": QT.F16,
        "attn_v.weight": QT.F32, "attn_output.weight": QT.Q8_0, "ffn_gate.weight": QT.F16, "ffn_up.weight": QT.Q8_0,
        "ffn_down.weight": QT.F32,
    }
    default_types |= types or {}
    writer = gguf_writer(path, arch, layers, hidden, inter, heads, kv_heads, metadata)
    writer.add_rope_freq_base(50000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    if bpe:
        writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(vocab - 3))])
        writer.add_token_merges(["a b"])
    else:
        writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_shape: tuple[int, ...], permute_heads: int = 0) -> None:
        if gguf_name in skip:
            return
        suffix = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
        qtype = default_types.get(gguf_name, default_types.get(suffix, QT.F32))
        if gguf_name in (raw or {}):
            blocks, raw_type = (raw or {})[gguf_name]
            assert not permute_heads
            writer.add_tensor(gguf_name, blocks, raw_dtype=raw_type)
            values = gguf.quants.dequantize(blocks, raw_type).reshape(hf_shape)
            expected[hf_tensor_name(gguf_name)] = torch.from_numpy(values)
            return
        original = (rng.standard_normal(hf_shape) * scale).astype(np.float32)
        # row permutation commutes with per-row block quantization, so dequant(quant(x)) is the expectation
        stored, values = _stored(original, qtype)
        if permute_heads:
            stored = _llama_cpp_permute(stored, permute_heads)
        if qtype in (QT.F32, QT.F16):
            writer.add_tensor(gguf_name, stored)
        else:
            writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
        expected[hf_tensor_name(gguf_name)] = torch.from_numpy(values)

    permute = arch == "llama"
    add("token_embd.weight", (vocab, hidden))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), heads if permute else 0)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), kv_heads if permute else 0)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        if bias:
            add(f"blk.{i}.attn_q.bias", (heads * head_dim,), heads if permute else 0)
            add(f"blk.{i}.attn_k.bias", (kv_heads * head_dim,), kv_heads if permute else 0)
            add(f"blk.{i}.attn_v.bias", (kv_heads * head_dim,))
        add(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
        add(f"blk.{i}.ffn_gate.weight", (inter, hidden))
        add(f"blk.{i}.ffn_up.weight", (inter, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, inter))
    add("output_norm.weight", (hidden,))
    if untied:
        add("output.weight", (vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
