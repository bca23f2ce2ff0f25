"""Linear layers whose method is chosen once, when the model is built (vLLM's ``LinearMethodBase`` idea).

A layer owns its parameters in the checkpoint layout -- ``weight [N, K]`` and optional ``bias [N]`` -- and
delegates the arithmetic to a :class:`LinearMethod`:

* :class:`TorchLinearMethod`: ``F.linear`` on the weights as loaded.
* :class:`TorchF32LinearMethod`: ``F.linear`` in float32 on weights widened once at load (the ``torch_fp32``
  dense backend: the fast path where torch has no native bf16 GEMM).
* :class:`PackedBF16LinearMethod`: kv8's packed kernel (:meth:`DenseKernels.linear`; AVX-512 BF16 / AMX, or AVX2). After
  loading, :meth:`~LinearMethod.process_weights_after_loading` replaces ``weight`` by its packed layout
  (buffer ``packed``) and the bias by a float32 copy, so the weights stay in memory once.

With ``quantization="fp8"`` (:attr:`DenseBackend.quantization`) the decoder's layers (every one but the
replicated :class:`Linear`, i.e. the LM head) keep their weights as E4M3 codes with a float32 scale per output
row (:mod:`kv8.quant.weights`), quantized after loading (each rank its own shard):

* :class:`PackedFP8LinearMethod`: the packed kernel reading the codes (``packed`` uint8, ``scale_f32``): half
  the bytes of the bf16 layout; each panel is decoded to bf16 on the fly and the scale applied in the epilogue.
* :class:`TorchFP8LinearMethod`: ``F.linear`` on the dequantized weight (``decode(codes) * scale`` in the
  layer's dtype), for the torch backend: the same quantized weights, without the kernel.
* :class:`ScaledMMFP8LinearMethod` (CUDA GPUs with FP8 tensor cores, :attr:`DenseBackend.fp8_scaled_mm`): the same
  codes and scales multiplied by ``torch._scaled_mm`` against the activations quantized to E4M3 per row
  (``amax / 448``), as vLLM's FP8 layers do on Hopper: W8A8, so its outputs differ from the weight-only methods by
  the activations' rounding (:func:`scaled_mm_fp8_reference` is its plain torch definition).

With ``quantization="gguf"`` (a GGUF checkpoint) the decoder's layers keep the file's blocks (Q8_0, Q4_0, Q4_1,
Q5_0, Q4_K, Q6_K: :mod:`kv8.quant.gguf_blocks`), never expanded: the loader hands each such tensor over as a
:class:`~kv8.quant.gguf_blocks.GGUFWeight` (``load_gguf``), and :class:`GGUFLinearMethod` keeps the merged rows'
bytes (:class:`GGUFSegment`: one per run of projections of one type) and multiplies them with the kernel
(``DenseKernels.gguf_linear``: int8 activations per block of 32, within
:func:`~kv8.quant.gguf_blocks.gguf_activation_bound` of the float32 reference) below :data:`GGUF_DEQUANTIZE_ROWS`
rows, from there with the blocks dequantized to a transient float32 matrix (``DenseKernels.gguf_dequantize``) and
the float32 GEMM (:func:`linear_f32`), or, without the kernels, with
:func:`~kv8.quant.gguf_blocks.gguf_linear_reference` (the blocks dequantized to float32 in torch at each call). A
tensor of another type (Q5_K, Q3_K, F16, ...) comes dequantized to the compute dtype, alone
(:class:`~kv8.quant.gguf_blocks.ExpandedWeight`; the loader warns once), and its rows are multiplied as bf16
weights.

Merged layers hold several projections that read the same input as one matrix, their outputs side by side:
:class:`QKVLinear` (shards ``"q"``, ``"k"``, ``"v"``) and :class:`MergedLinear` (shards ``0, 1, ...``, e.g.
gate and up). The loader gives each checkpoint tensor to ``param.weight_loader(param, tensor, shard_id)``,
which copies it into its rows; a model names the shards in ``packed_modules_mapping``. A checkpoint that
stores the merged matrix itself (Phi-3's ``qkv_proj`` and ``gate_up_proj``) loads it whole (``shard_id=None``),
its shape checked against the whole parameter.

Invariants: ``layer(x)`` is ``[..., N]`` in x's dtype for any number of leading dims; each output row depends
only on its own input row (:class:`GGUFLinearMethod`: and on which side of its row threshold the call is).
The packed method equals :func:`linear_reference` (exact bf16 products, fp32 sums, one rounding to bf16) up to the
order of the fp32 additions.

Tensor parallelism (:mod:`kv8.distributed.shard`; the group is the one the model is built for): every layer
keeps the checkpoint's sizes (``full_output_sizes``, ``full_in_features``) and holds its rank's part
(``output_sizes``, ``in_features``); ``weight_loader`` takes the whole checkpoint tensor, checks it against
the full shape and copies the rank's rows (and columns) in.

* :class:`QKVLinear` and :class:`MergedLinear` are column-parallel: each projection keeps the rank's heads /
  columns (KV heads replicated when there are fewer than ranks).
* :class:`RowParallelLinear` (o_proj, down_proj) keeps the rank's input columns and sums the ranks' partial
  outputs with one all-reduce; its bias is loaded on rank 0 only (zeros elsewhere), so it is added once.
* :class:`Linear` is replicated, and keeps its weights as loaded under ``quantization="fp8"``. (The LM head,
  :class:`~kv8.layers.vocab_parallel.ParallelLMHead`, keeps its weights as loaded under ``"fp8"`` and as the file's
  blocks under ``"gguf"``.)

Under ``quantization="gguf"`` ``load_gguf`` takes the whole checkpoint tensor too and keeps the rank's part of its
blocks (:func:`~kv8.quant.gguf_blocks.shard_weight`): whole rows of blocks for the column-parallel layers, and for
:class:`RowParallelLinear` the rank's columns, which must be whole blocks (32 values; Q4_K 256): a split that is not
(``in_features`` / ``tensor_parallel_size`` not a multiple of the block) is a ``ValueError`` naming the layer, its
``in_features``, the block and ``tensor_parallel_size``.

With one rank every layer holds the whole matrix and nothing is reduced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kv8.distributed.shard import kv_head_shard, shard_group, split_evenly
from kv8.kernels.cpu.dense import FP8_REGISTER_ROWS, DenseKernels
from kv8.layers.activation import SiluAndMul
from kv8.layers.dense_backend import GGUF_DEQUANTIZE_ROWS, GGUF_EXPANSIONS, DenseBackend
from kv8.quant.formats import E4M3
from kv8.quant.gguf_blocks import (
    BLOCK_VALUES,
    GROUP_ROWS,
    ExpandedWeight,
    GGUFWeight,
    block_aligned,
    dequantize_rows,
    gguf_linear_reference,
    group_blocks,
    shard_weight,
    ungroup_blocks,
)
from kv8.quant.weights import dequantize_fp8_rows, quantize_fp8_rows

_E4M3_MAX = E4M3.max_finite

__all__ = ["WIDE_ROWS", "WIDE_SLAB_VALUES", "GGUF_DEQUANTIZE_ROWS", "GGUF_SCRATCH_BYTES", "GGUFLinearMethod",
           "GGUFSegment", "GateUpLinear", "Linear", "LinearBase", "LinearMethod", "MergedLinear",
           "PackedBF16LinearMethod", "PackedFP8LinearMethod", "QKVLinear", "RowParallelLinear",
           "ScaledMMFP8LinearMethod", "TorchFP8LinearMethod", "TorchF32LinearMethod", "TorchLinearMethod",
           "gguf_segment", "linear_f32", "linear_method", "linear_reference", "quantize_fp8_activations",
           "scaled_mm_fp8_reference"]


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the packed kernel computes, in plain torch: float32 products and sums, one rounding to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class LinearMethod:
    """How a :class:`LinearBase` layer computes ``x @ W.T + b``."""

    name = "abstract"

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turn the loaded ``weight`` / ``bias`` into what :meth:`apply` reads (called once, after loading)."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_gated(self, layer: GateUpLinear, x: torch.Tensor) -> torch.Tensor:
        """``layer.act_fn(x @ W.T + b)`` for a :class:`GateUpLinear`: the projection, then its activation."""
        return layer.act_fn(self.apply(layer, x))


class TorchLinearMethod(LinearMethod):
    name = "torch"

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class TorchF32LinearMethod(LinearMethod):
    """The weights held in float32 (``weight_f32``, ``bias_f32``; a bf16 or fp16 weight widens exactly; FP8 codes
    decode to ``decode(codes) * scale``) and ``F.linear`` in float32, one rounding to x's dtype:
    :func:`linear_reference`'s arithmetic. For CPUs whose torch has no native bf16 GEMM (AVX2 without AVX-512 BF16
    or AMX), where a float32 GEMM runs 5-20x faster than a bf16 one, at twice the bf16 weights' memory (there kv8's AVX2
    kernels read the bf16 weights, half those bytes; the tuner chooses by measurement). Like the
    packed methods, the layer keeps no ``weight`` / ``bias`` parameter after loading."""

    name = "torch_fp32"

    def __init__(self, fp8: bool = False) -> None:
        self.fp8 = fp8

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight.detach()
        if self.fp8:
            codes, scale = quantize_fp8_rows(weight, layer.row_amax)
            weight_f32 = dequantize_fp8_rows(codes, scale, torch.float32)
        else:
            weight_f32 = weight.float()
        layer.register_buffer("weight_f32", weight_f32.contiguous(), persistent=False)
        bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        layer.register_buffer("bias_f32", bias, persistent=False)
        del layer.weight, layer.bias

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return linear_f32(x, layer.weight_f32, layer.bias_f32)


def linear_f32(x: torch.Tensor, weight_f32: torch.Tensor, bias_f32: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32 on float32 weights, one rounding to x's dtype: :class:`TorchF32LinearMethod`'s GEMM,
    which :class:`GGUFLinearMethod` also uses on its blocks dequantized for many rows."""
    return F.linear(x.float(), weight_f32, bias_f32).to(x.dtype)


#: rows of a call from which a packed layer (bf16 or FP8) may multiply in float32 (:class:`PackedBF16LinearMethod`'s
#: ``wide_rows``, chosen per machine by :mod:`kv8.layers.tuning`), and the float32 scratch of one slab of rows
WIDE_ROWS = 512
WIDE_SLAB_VALUES = 1 << 22


class PackedBF16LinearMethod(LinearMethod):
    """bf16 only. After loading the layer holds ``packed`` (1-D bf16) and ``bias_f32`` (``[N]`` float32 or
    None) as non-persistent buffers, and no ``weight`` / ``bias`` parameters. A :class:`GateUpLinear` that fuses
    SiLU holds both with its gate and up rows interleaved by 16 (:meth:`DenseKernels.interleave_gate_up`).

    ``wide_rows`` (0: never): a call of at least that many rows (a long prefill chunk) widens the packed weight to
    float32 a slab of rows at a time (:meth:`DenseKernels.unpack`, at most :data:`WIDE_SLAB_VALUES` values) and
    multiplies with torch's float32 GEMM (:func:`linear_f32`): on CPUs whose bf16 dot product has no more
    throughput than float32 FMAs (Intel without AMX) that GEMM is faster than the packed kernel, and the widening
    costs one read of the weights per call. Same arithmetic (exact products, float32 sums, one rounding; the gated
    case runs ``kv8_silu_mul`` on the rounded projection, which the fused kernel equals); outputs differ from the
    packed kernel's by the order of the float32 additions."""

    name = "packed_bf16"

    def __init__(self, kernels: DenseKernels, wide_rows: int = 0) -> None:
        if wide_rows < 0:
            raise ValueError(f"wide_rows={wide_rows} must be >= 0 (0: never)")
        self.kernels = kernels
        self.wide_rows = wide_rows

    def _wide(self, rows: torch.Tensor) -> bool:
        return self.wide_rows > 0 and rows.shape[0] >= self.wide_rows

    def _wide_linear(self, layer: LinearBase, rows: torch.Tensor, out_features: int) -> torch.Tensor:
        """The float32 GEMM of ``rows`` with the packed weight's first ``out_features`` rows, slab by slab."""
        k = layer.in_features
        slab = max(32, WIDE_SLAB_VALUES // k // 32 * 32)
        x = rows.float()
        out = torch.empty(rows.shape[0], out_features, dtype=rows.dtype)
        for n0 in range(0, out_features, slab):
            n = min(slab, out_features - n0)
            bias = None if layer.bias_f32 is None else layer.bias_f32[n0:n0 + n]
            out[:, n0:n0 + n] = F.linear(x, self._unpack(layer, n0, n), bias)
        return out

    def _unpack(self, layer: LinearBase, first: int, rows: int) -> torch.Tensor:
        """Packed rows ``first .. first + rows`` as float32 ``[rows, in_features]``: the weights, exactly."""
        return self.kernels.unpack(layer.packed, first, rows, layer.in_features)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight.detach()
        bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        if isinstance(layer, GateUpLinear) and layer.fuses_silu:   # gate and up rows interleaved by 16
            weight = self.kernels.interleave_gate_up(weight)
            bias = None if bias is None else self.kernels.interleave_gate_up(bias).contiguous()
        self._pack(layer, weight)
        layer.register_buffer("bias_f32", bias, persistent=False)
        del layer.weight, layer.bias   # the packed layout is the only copy kept

    def _pack(self, layer: LinearBase, weight: torch.Tensor) -> None:
        """The layer's buffers of ``weight`` (its rows in the kernel's order)."""
        layer.register_buffer("packed", self.kernels.pack(weight), persistent=False)

    def _rows(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the packed bf16 linear method takes bfloat16 input, got {x.dtype}")
        if x.shape[-1] != layer.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {layer.in_features}")
        return x.reshape(-1, layer.in_features).contiguous()

    def _linear(self, layer: LinearBase, rows: torch.Tensor, out_features: int, gated: bool = False) -> torch.Tensor:
        if self._wide(rows) and not gated:
            return self._wide_linear(layer, rows, out_features)
        return self.kernels.linear(rows, layer.packed, out_features, layer.bias_f32, gated=gated)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = self._rows(layer, x)
        if isinstance(layer, GateUpLinear) and layer.fuses_silu:
            # the interleaved layout's [gate_0..15 | up_0..15 | gate_16..31 | ...] back to [gate | up]
            i, ip = layer.output_sizes[0], layer.packed_half
            out = self._linear(layer, rows, 2 * ip)
            out = out.view(-1, ip // 16, 2, 16).transpose(1, 2).reshape(-1, 2, ip)[:, :, :i].reshape(-1, 2 * i)
            return out.view(*lead, 2 * i)
        out = self._linear(layer, rows, layer.out_features)
        return out.view(*lead, layer.out_features)

    def apply_gated(self, layer: GateUpLinear, x: torch.Tensor) -> torch.Tensor:
        if not layer.fuses_silu:
            return super().apply_gated(layer, x)
        lead = x.shape[:-1]
        i = layer.output_sizes[0]
        rows = self._rows(layer, x)
        if self._wide(rows):   # the projection in float32, then the fused kernel's epilogue on it
            return self.kernels.silu_mul(self.apply(layer, rows)).view(*lead, i)
        out = self._linear(layer, rows, i, gated=True)
        return out.view(*lead, i)


class PackedFP8LinearMethod(PackedBF16LinearMethod):
    """FP8 weights on the packed kernel. After loading the layer holds ``packed`` (1-D uint8: E4M3 codes in
    :meth:`DenseKernels.pack_fp8`'s order), ``scale_f32`` (``[rows]`` float32, one per packed row) and
    ``bias_f32``; a fused :class:`GateUpLinear` has all three in the interleaved order. Input and output are
    bf16, as for the bf16 method; each output is ``bf16(sum_k x_k decode(code_nk) * scale_n + bias_n)``.

    ``wide_rows`` (0: never), as for the bf16 method: a call of at least that many rows decodes the codes times their
    row's scale to float32 a slab of rows at a time (:meth:`DenseKernels.unpack` with ``scale``: the weight of
    :func:`~kv8.quant.weights.dequantize_fp8_rows`, the ``torch_fp32`` method's with FP8 weights, bit for bit) and
    multiplies with :func:`linear_f32`; the gated case runs ``kv8_silu_mul`` on the rounded projection. Its outputs
    differ from the packed kernel's by the order of the float32 additions and by where the scale enters: here each
    weight ``decode(code) * scale`` is rounded to float32 (a relative 2^-24) and each product with it rounds too,
    where the kernel's products ``x * decode(code)`` are exact and the scale multiplies each sum once; both are far
    below the one rounding of the output to bf16 (2^-9).

    ``register_rows``: calls of up to that many rows decode the codes in registers, longer ones into a buffer once
    per call (:data:`kv8.kernels.cpu.dense.FP8_REGISTER_ROWS`; the same bits, chosen per machine)."""

    name = "packed_fp8"

    def __init__(self, kernels: DenseKernels, wide_rows: int = 0, register_rows: int = FP8_REGISTER_ROWS) -> None:
        super().__init__(kernels, wide_rows)
        if register_rows < 0:
            raise ValueError(f"register_rows={register_rows} must be >= 0")
        self.register_rows = register_rows

    def _pack(self, layer: LinearBase, weight: torch.Tensor) -> None:
        codes, scale = quantize_fp8_rows(weight, layer.row_amax)
        layer.register_buffer("packed", self.kernels.pack_fp8(codes), persistent=False)
        layer.register_buffer("scale_f32", scale, persistent=False)

    def _unpack(self, layer: LinearBase, first: int, rows: int) -> torch.Tensor:
        """Packed rows ``first .. first + rows`` as float32: ``decode(code) * scale``, one rounding each."""
        return self.kernels.unpack(layer.packed, first, rows, layer.in_features, scale=layer.scale_f32)

    def _linear(self, layer: LinearBase, rows: torch.Tensor, out_features: int, gated: bool = False) -> torch.Tensor:
        if self._wide(rows) and not gated:
            return self._wide_linear(layer, rows, out_features)
        return self.kernels.linear(rows, layer.packed, out_features, layer.bias_f32, gated=gated,
                                   scale=layer.scale_f32, fp8_register_rows=self.register_rows)


class TorchFP8LinearMethod(TorchLinearMethod):
    """FP8 weights with torch ops: after loading ``weight`` holds ``decode(codes) * scale`` in its dtype (the
    quantized weight, dequantized once), and ``F.linear`` multiplies by it."""

    name = "torch_fp8"

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        codes, scale = quantize_fp8_rows(layer.weight.detach(), layer.row_amax)
        layer.weight.data = dequantize_fp8_rows(codes, scale, layer.weight.dtype)


def quantize_fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [M, K]`` -> ``(float8_e4m3fn [M, K], scale [M, 1] float32)``, ``x ~ codes * scale`` with
    ``scale = amax(|row|) / 448`` (a row of zeros: the smallest normal float32, so it stays zeros)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / _E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (xf / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn), scale


def scaled_mm_fp8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
    """What :class:`ScaledMMFP8LinearMethod` computes, in plain torch: ``x [M, K]`` quantized per row, times the
    weight's E4M3 ``codes [N, K]`` (uint8) with ``scale [N]``, float32 sums, plus ``bias``, in x's dtype."""
    a, a_scale = quantize_fp8_activations(x)
    y = (a.float() * a_scale) @ (E4M3.decode(codes) * scale[:, None]).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class ScaledMMFP8LinearMethod(LinearMethod):
    """FP8 weights times FP8 activations on tensor cores. After loading the layer holds ``weight_fp8`` (``[N, K]``
    float8_e4m3fn, the codes of :func:`kv8.quant.weights.quantize_fp8_rows`), ``scale_row`` (``[1, N]`` float32)
    and its ``bias`` as loaded. ``torch._scaled_mm`` needs ``K`` and ``N`` multiples of 16: a layer whose are not
    keeps the dequantized weight and uses ``F.linear`` (as :class:`TorchFP8LinearMethod`)."""

    name = "scaled_mm_fp8"

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        codes, scale = quantize_fp8_rows(layer.weight.detach(), layer.row_amax)
        if layer.in_features % 16 or layer.out_features % 16:
            layer.weight.data = dequantize_fp8_rows(codes, scale, layer.weight.dtype)
            return
        layer.register_buffer("weight_fp8", codes.view(torch.float8_e4m3fn), persistent=False)
        layer.register_buffer("scale_row", scale.view(1, -1), persistent=False)
        del layer.weight

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(layer, "weight_fp8"):
            return F.linear(x, layer.weight, layer.bias)
        lead = x.shape[:-1]
        rows = x.reshape(-1, layer.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*lead, layer.out_features)
        a, a_scale = quantize_fp8_activations(rows)
        # the bias is added in the epilogue, before the one rounding to x's dtype
        y = torch._scaled_mm(a, layer.weight_fp8.t(), scale_a=a_scale, scale_b=layer.scale_row, bias=layer.bias,
                             out_dtype=x.dtype)
        return y.view(*lead, layer.out_features)


#: the most float32 scratch GGUFLinearMethod dequantizes blocks into at once: a larger segment (an LM head: SmolLM2's is
#: 113 MB in float32, Gemma-3-270M's 671 MB) is multiplied in slices of rows. Measured on the Xeon (model 207, one
#: thread, the SmolLM2 head): slices of 3,640 rows 1.3-1.5x faster than the whole matrix at once at 512 rows, 2.5x at
#: 32; no decoder layer of SmolLM2 is sliced (its largest, gate/up, is 6.75 MiB in float32).
GGUF_SCRATCH_BYTES = 8 << 20


class GGUFSegment(nn.Module):
    """Consecutive output rows of a :class:`GGUFLinearMethod` layer held one way: the blocks of one kept type
    (``qtype`` in :data:`~kv8.quant.gguf_blocks.KEPT_TYPES`; buffer ``blocks`` uint8 ``[rows, row bytes]``, in the
    kernel's order when ``grouped``), or, ``expanded``, tensors of a type no kernel reads (``qtype`` e.g. ``"Q5_K"``)
    dequantized at load to the compute dtype (buffer ``weight [rows, K]``, or ``packed`` for the packed bf16 kernel).
    ``tensors`` counts the file's tensors in it (merged projections of the same type share a segment)."""

    blocks: torch.Tensor
    weight: torch.Tensor
    packed: torch.Tensor

    def __init__(self, qtype: str, rows: int, in_features: int, expanded: bool, tensors: int) -> None:
        super().__init__()
        self.qtype, self.rows, self.in_features = qtype, rows, in_features
        self.expanded, self.tensors = expanded, tensors
        self.grouped = False

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, in_features)``: the Hugging Face shape of the weight it holds."""
        return (self.rows, self.in_features)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids [T]`` of the weight, ``[T, in_features]`` in ``dtype`` (an embedding's lookup): the blocks of
        those rows alone dequantized (:func:`~kv8.quant.gguf_blocks.dequantize_rows`, float32, then one rounding to
        ``dtype``: the values the loader's dequantized embedding holds). Blocks only (not ``expanded``)."""
        if self.expanded:
            raise ValueError(f"this segment holds {self.qtype} tensors dequantized at load, not blocks")
        return dequantize_rows(self.blocks, self.qtype, self.in_features, ids, self.grouped).to(dtype)

    def file_blocks(self) -> torch.Tensor:
        """The segment's blocks in the file's layout (``blocks`` itself, or ungrouped from the kernel's)."""
        if self.expanded:
            raise ValueError(f"this segment holds {self.qtype} tensors dequantized at load, not blocks")
        return ungroup_blocks(self.blocks, self.qtype, self.in_features) if self.grouped else self.blocks

    def nbytes(self) -> int:
        """The bytes it keeps resident."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        how = "expanded" if self.expanded else "grouped blocks" if self.grouped else "blocks"
        return f"{self.qtype} {how}, rows={self.rows}, tensors={self.tensors}"


def gguf_segment(run: Sequence[GGUFWeight | ExpandedWeight], in_features: int,
                 kernels: DenseKernels | None) -> GGUFSegment:
    """One :class:`GGUFSegment` holding ``run`` (weights of one type and kind, their rows in order) as
    :class:`GGUFLinearMethod` reads it: blocks grouped in the kernel's order where ``kernels`` read the type, an
    expanded weight packed for the bf16 kernel where ``kernels`` are loaded and it is bf16."""
    rows = sum(part.shape[0] for part in run)
    first = run[0]
    segment = GGUFSegment(first.qtype, rows, in_features, isinstance(first, ExpandedWeight), len(run))
    if isinstance(first, ExpandedWeight):
        weights = [part.weight for part in run if isinstance(part, ExpandedWeight)]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        if kernels is not None and weight.dtype == torch.bfloat16:
            segment.register_buffer("packed", kernels.pack(weight.contiguous()), persistent=False)
        else:
            segment.register_buffer("weight", weight.contiguous(), persistent=False)
        return segment
    kept = [part.blocks for part in run if isinstance(part, GGUFWeight)]
    blocks = kept[0] if len(kept) == 1 else torch.cat(kept)
    segment.grouped = kernels is not None and first.qtype in kernels.gguf_types
    if segment.grouped:   # the kernel's order of the same bytes
        blocks = group_blocks(blocks, first.qtype, in_features)
    segment.register_buffer("blocks", blocks.contiguous(), persistent=False)
    return segment


class GGUFLinearMethod(LinearMethod):
    """GGUF blocks kept as the file's bytes. After loading the layer holds ``gguf_segments`` (an ``nn.ModuleList`` of
    :class:`GGUFSegment`: its projections' rows in order, consecutive projections of the same type in one segment)
    and ``bias_f32``, and no ``weight`` / ``bias`` parameters; the resident bytes are the file's bytes of the tensors
    kept as blocks, plus the dequantized ones. A merged layer may mix types (Gemma-3's Q4_K_M file: q/k Q5_0 and v
    Q8_0): each segment is multiplied alone and the outputs are concatenated.

    ``apply`` on ``M`` rows (the leading dims flattened), per segment of blocks where the kernels read the type
    (``grouped``):

    * bf16 input and ``M < dequantize_rows`` (``dequantize_rows`` 0: any ``M``): the int8 kernel
      (``kernels.gguf_linear``: activations rounded to int8 per block of 32, within
      :func:`~kv8.quant.gguf_blocks.gguf_activation_bound` of the float32 reference plus one bf16 rounding;
      ``csrc/dense/gguf.h``). It reads each block once per 4 rows: the fast path for decode.
    * ``M >= dequantize_rows`` (or another input dtype): the blocks dequantized to a float32 scratch matrix by
      ``kernels.gguf_dequantize`` (bit for bit :func:`~kv8.quant.gguf_blocks.dequantize_blocks`), then
      :func:`linear_f32` -- the ``torch_fp32`` backend's GEMM, the default weights' GEMM on CPUs without a native
      bf16 one -- a slice of rows at a time where the segment's float32 weights exceed :data:`GGUF_SCRATCH_BYTES`
      (an LM head; slices start at multiples of 8 rows, whole groups of the kernel's layout). The scratch is
      allocated per call and freed after it; only the blocks stay resident. The result is
      :func:`~kv8.quant.gguf_blocks.gguf_linear_reference`'s (no activation rounding) up to the order of the float32
      sums. Where the segment's expansion is ``"bf16"`` (``expansion``, ``type_expansion``; bf16 input) the blocks
      are instead dequantized straight into the packed bf16 kernel's layout (``kernels.gguf_dequantize_packed``: each
      value the float32 one rounded to bf16, in one pass; slices of :data:`GGUF_SCRATCH_BYTES` of bf16 panels) and
      multiplied by ``kernels.linear`` (AMX tiles where the CPU has them; float32 sums and bias, one rounding): the
      reference's result on bf16-rounded weights (2^-9 relative per weight), as a GGUF file dequantized to bf16 at
      load gives. A :class:`GateUpLinear` of one such segment, no bias and :class:`SiluAndMul` runs the packed
      kernel's gated form (``apply_gated``: the activation in the epilogue, with the roundings of the unfused pair).

    Without the kernels for the type, :func:`gguf_linear_reference` (float32 on the blocks dequantized in torch at
    each call, in the same slices): the oracle, and the path of builds without the AVX2 kernels. An expanded segment
    (a type the loader dequantized, :class:`~kv8.quant.gguf_blocks.ExpandedWeight`) runs the packed bf16 kernel where
    the kernels are loaded and its weights are bf16 (packed at load; bf16 input), else :func:`linear_reference`.

    ``type_paths`` gives a block type the int8 kernel's path its calls of one row run, ``path`` the other types' (the
    dense backend's ``gguf_kernel_paths`` and, for the LM head, ``gguf_head_path``: timed per machine; None: the
    kernels' default, which calls of more rows always run); every path computes the same bits.

    ``dequantize_rows`` (default :data:`GGUF_DEQUANTIZE_ROWS`) is the row count from which dequantizing wins, 0 where
    it never does (AVX-512 VNNI); ``type_rows`` gives a block type its own (the dense backend's ``wide_rows`` and
    ``gguf_wide_rows``, timed per machine and type): each segment switches at its type's count
    (:meth:`dequantize_rows_of`). The two paths round differently, so a row's result depends on whether its call has
    fewer rows than that (e.g. a sequence decoded alone or in a large batch): within the int8 kernel's bound of each
    other, not bit for bit."""

    name = "gguf"

    def __init__(self, kernels: DenseKernels | None, dequantize_rows: int = GGUF_DEQUANTIZE_ROWS,
                 type_rows: Mapping[str, int] | None = None, expansion: str = "f32",
                 type_expansion: Mapping[str, str] | None = None, type_paths: Mapping[str, str] | None = None,
                 path: str | None = None) -> None:
        for what, rows in [("dequantize_rows", dequantize_rows), *(type_rows or {}).items()]:
            if rows < 0:
                raise ValueError(f"{what}: the row count from which blocks are dequantized must be >= 0 (0: the int8 "
                                 f"kernel at every row count), got {rows}")
        for what, kind in [("expansion", expansion), *(type_expansion or {}).items()]:
            if kind not in GGUF_EXPANSIONS:
                raise ValueError(f"{what}: blocks are dequantized to one of {', '.join(GGUF_EXPANSIONS)}, got {kind!r}")
        self.kernels = kernels
        self.dequantize_rows = dequantize_rows
        self.type_rows = dict(type_rows or {})
        self.expansion = expansion
        self.type_expansion = dict(type_expansion or {})
        self.type_paths = dict(type_paths or {})   # block type -> the int8 kernel's path at one row (else ``path``)
        self.path = path or None                    # the other types' path at one row (None: the kernels' default)

    def dequantize_rows_of(self, qtype: str) -> int:
        """The row count from which segments of block type ``qtype`` are dequantized (0: never)."""
        return self.type_rows.get(qtype, self.dequantize_rows)

    def expansion_of(self, qtype: str) -> str:
        """What segments of block type ``qtype`` are dequantized to (:data:`GGUF_EXPANSIONS`)."""
        return self.type_expansion.get(qtype, self.expansion)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        parts = layer.gguf_parts
        missing = [i for i in range(len(layer.output_sizes)) if i not in parts]
        if missing:
            raise ValueError(f"{type(layer).__name__}: quantization='gguf' needs every projection's GGUF tensor; "
                             f"projections {missing} were not loaded")
        # consecutive projections of one type, held one way; a segment built already (a tied LM head: the
        # embedding's blocks) is used as it is
        held: list[GGUFSegment | list[GGUFWeight | ExpandedWeight]] = []
        for i in range(len(layer.output_sizes)):
            part, last = parts[i], held[-1] if held else None
            if (isinstance(last, list) and not isinstance(part, GGUFSegment) and type(last[0]) is type(part)
                    and last[0].qtype == part.qtype):
                last.append(part)
            else:
                held.append(part if isinstance(part, GGUFSegment) else [part])
        layer.gguf_segments = nn.ModuleList(h if isinstance(h, GGUFSegment) else
                                            gguf_segment(h, layer.in_features, self.kernels) for h in held)
        bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        layer.register_buffer("bias_f32", bias, persistent=False)
        layer.gguf_parts = {}
        del layer.weight, layer.bias

    def _apply_segment(self, segment: GGUFSegment, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``rows [M, K] @ W_segment.T (+ bias)`` -> ``[M, segment.rows]`` in rows' dtype."""
        if segment.expanded:
            if hasattr(segment, "packed"):
                if rows.dtype != torch.bfloat16:
                    raise ValueError(f"the layer's {segment.qtype} rows are packed bf16 weights; they take bfloat16 "
                                     f"input, got {rows.dtype}")
                assert self.kernels is not None
                return self.kernels.linear(rows.contiguous(), segment.packed, segment.rows, bias)
            return linear_reference(rows, segment.weight, bias)
        kernel = segment.grouped and self.kernels is not None
        switch = self.dequantize_rows_of(segment.qtype)
        if kernel and rows.dtype == torch.bfloat16 and (switch == 0 or rows.shape[0] < switch):
            assert self.kernels is not None
            path = self.type_paths.get(segment.qtype, self.path) if rows.shape[0] == 1 else None
            return self.kernels.gguf_linear(rows, segment.blocks, segment.qtype, segment.rows, bias, path)
        if self._packs(segment, rows):
            return self._packed_product(segment, rows.contiguous(), bias)
        # the blocks dequantized to float32, GGUF_SCRATCH_BYTES at a time (whole groups of the kernel's layout: a
        # slice of grouped rows from a multiple of 8 is that layout of those rows); the scratch lives for this call
        step = max(GROUP_ROWS, GGUF_SCRATCH_BYTES // (4 * segment.in_features) // GROUP_ROWS * GROUP_ROWS)
        return self._in_slices(rows, segment.rows, 1, step, bias, lambda first, count, _columns, part_bias: (
            self._dequantized_product(segment, segment.blocks.narrow(0, first, count), rows, part_bias)))

    @staticmethod
    def _in_slices(rows: torch.Tensor, width: int, per: int, step: int, bias: torch.Tensor | None,
                   product: Callable[[int, int, int, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        """``[M, width]``: the output columns in units of ``per`` (a weight row, a packed panel), ``step`` units at a
        time: ``product(first, count, columns, bias of those columns)`` gives the ``columns`` output columns of units
        ``first .. first + count`` (the last unit may be short); one call where one slice holds them all."""
        units = -(-width // per)
        if units <= step:
            return product(0, units, width, bias)
        out = rows.new_empty(rows.shape[0], width)
        for first in range(0, units, step):
            count = min(step, units - first)
            c0, c1 = first * per, min((first + count) * per, width)
            out[:, c0:c1] = product(first, count, c1 - c0, None if bias is None else bias[c0:c1])
        return out

    def _dequantized_product(self, segment: GGUFSegment, blocks: torch.Tensor, rows: torch.Tensor,
                             bias: torch.Tensor | None) -> torch.Tensor:
        """``rows @ W.T (+ bias)`` for the weight rows ``blocks`` of ``segment`` dequantized to float32: the kernels'
        dequantization and :func:`linear_f32`, or :func:`gguf_linear_reference` (torch)."""
        if segment.grouped and self.kernels is not None:
            return linear_f32(rows, self.kernels.gguf_dequantize(blocks, segment.qtype, segment.in_features), bias)
        return gguf_linear_reference(rows, blocks, segment.qtype, bias)

    def _packs(self, segment: GGUFSegment, rows: torch.Tensor) -> bool:
        """Whether ``rows`` multiply ``segment`` on its blocks dequantized into the packed kernel's layout: blocks the
        kernels read, bf16 rows from the type's switch on, and the bf16 expansion."""
        switch = self.dequantize_rows_of(segment.qtype)
        return (segment.grouped and self.kernels is not None and rows.dtype == torch.bfloat16 and switch > 0
                and rows.shape[0] >= switch and self.expansion_of(segment.qtype) == "bf16")

    def _packed_product(self, segment: GGUFSegment, rows: torch.Tensor, bias: torch.Tensor | None,
                        gated: bool = False) -> torch.Tensor:
        """``rows [M, K]`` (bf16, contiguous) ``@ W_segment.T (+ bias)`` by the packed kernel on the blocks dequantized
        into its layout, :data:`GGUF_SCRATCH_BYTES` of bf16 panels at a time; ``gated`` (no bias): ``silu(gate) * up``
        of ``W = [gate; up]``, ``[M, rows / 2]``."""
        kernels = self.kernels
        assert kernels is not None and not (gated and bias is not None)
        width, per_panel = (segment.rows // 2, 16) if gated else (segment.rows, 32)
        step = max(1, GGUF_SCRATCH_BYTES // (2 * 32 * segment.in_features))   # panels a slice

        def product(first: int, count: int, columns: int, part_bias: torch.Tensor | None) -> torch.Tensor:
            packed = kernels.gguf_dequantize_packed(segment.blocks, segment.qtype, segment.in_features, gated, first,
                                                    count)
            return kernels.linear(rows, packed, columns, part_bias, gated=gated)

        return self._in_slices(rows, width, per_panel, step, bias, product)

    def apply_gated(self, layer: GateUpLinear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != layer.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {layer.in_features}")
        rows = x.reshape(-1, layer.in_features)
        segments = list(layer.gguf_segments)
        if (isinstance(layer.act_fn, SiluAndMul) and len(segments) == 1 and layer.bias_f32 is None
                and isinstance(segments[0], GGUFSegment) and self._packs(segments[0], rows)):
            out = self._packed_product(segments[0], rows.contiguous(), None, gated=True)
        else:
            out = super().apply_gated(layer, rows)
        return out.view(*x.shape[:-1], out.shape[-1])

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.shape[-1] != layer.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {layer.in_features}")
        rows = x.reshape(-1, layer.in_features)   # (M, K)
        outs, start = [], 0
        for segment in layer.gguf_segments:
            assert isinstance(segment, GGUFSegment)
            bias = None if layer.bias_f32 is None else layer.bias_f32[start:start + segment.rows]
            outs.append(self._apply_segment(segment, rows, bias))
            start += segment.rows
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)   # (M, N)
        return out.view(*lead, layer.out_features)


def linear_method(backend: DenseBackend, quantize: bool = True) -> LinearMethod:
    """The linear method of a dense backend; ``quantize=False`` keeps the weights as loaded whatever the
    backend's quantization (the LM head)."""
    if quantize and backend.quantization == "gguf":
        return GGUFLinearMethod(backend.kernels, backend.wide_rows, dict(backend.gguf_wide_rows), backend.gguf_expand,
                                {qtype: backend.expansion_of(qtype) for qtype, _ in backend.gguf_wide_rows},
                                dict(backend.gguf_kernel_paths))
    fp8 = quantize and backend.quantization == "fp8"
    if fp8 and backend.fp8_scaled_mm:
        return ScaledMMFP8LinearMethod()
    if backend.linear_fp32:
        return TorchF32LinearMethod(fp8)
    if backend.kernels is None:
        return TorchFP8LinearMethod() if fp8 else TorchLinearMethod()
    if fp8:
        return PackedFP8LinearMethod(backend.kernels, backend.wide_rows, backend.fp8_register_rows)
    # (a layer kept as loaded under quantization="gguf", e.g. an LM head of a type without a kernel: the backend's
    # wide_rows is the blocks' switch, not this method's)
    return PackedBF16LinearMethod(backend.kernels, backend.wide_rows if backend.quantization != "gguf" else 0)


class LinearBase(nn.Module):
    """``output_sizes`` projections of one input, stored as one ``weight [sum(output_sizes), in_features]``.

    Parameters are created on the current default device (the meta device while a model is built for
    loading); ``weight_loader`` copies one shard into its rows (``shard_id`` is resolved by
    :meth:`shard_index`). ``row_shards[i] = (start, count)``: the checkpoint rows of projection ``i`` this
    rank holds (default: all); ``in_shard``: the input columns it holds (default: all).
    """

    packed: torch.Tensor              # buffers of the packed methods, set by process_weights_after_loading
    weight_f32: torch.Tensor          # TorchF32LinearMethod's float32 weights
    bias_f32: torch.Tensor | None
    scale_f32: torch.Tensor           # the FP8 method's scale per packed row
    weight_fp8: torch.Tensor          # ScaledMMFP8LinearMethod's codes [N, K] and scales [1, N]
    scale_row: torch.Tensor
    gguf_segments: nn.ModuleList      # GGUFLinearMethod's GGUFSegments, its rows in order

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, backend: DenseBackend,
                 row_shards: Sequence[tuple[int, int]] | None = None, in_shard: tuple[int, int] | None = None,
                 quantize: bool = True) -> None:
        super().__init__()
        self.tp = shard_group()
        self.full_in_features = in_features
        self.full_output_sizes = list(output_sizes)
        self.row_shards = list(row_shards) if row_shards is not None else [(0, n) for n in output_sizes]
        self.in_shard = in_shard if in_shard is not None else (0, in_features)
        self.in_features = self.in_shard[1]
        self.output_sizes = [count for _, count in self.row_shards]
        self.out_features = sum(self.output_sizes)
        # a sharded layer loads through weight_loader (the loader cannot assign a whole checkpoint tensor)
        self.is_sharded = (self.in_features != in_features or self.output_sizes != self.full_output_sizes)
        self.has_bias = bias
        self.row_amax: torch.Tensor | None = None   # input-sharded layers: each whole checkpoint row's max |w|
        self.quantize = quantize   # the weights follow the backend's quantization (False: kept as loaded)
        self.method = linear_method(backend, quantize)
        # quantization="gguf": the projections' blocks, or tensors dequantized at load (load_gguf)
        self.gguf_parts: dict[int, GGUFWeight | ExpandedWeight | GGUFSegment] = {}
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def shard_index(self, shard_id: int | str | None) -> int:
        """Index into ``output_sizes`` of a shard id (a plain layer has none: it loads whole)."""
        raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        """Copy this rank's part of ``loaded`` (a whole checkpoint tensor, any float dtype) into ``param``: one
        projection's rows, or with ``shard_id=None`` every projection (a checkpoint that stores the merged
        matrix, e.g. Phi-3's ``qkv_proj``). ``loaded`` is checked against the checkpoint's full shape."""
        projections = range(len(self.full_output_sizes)) if shard_id is None else [self.shard_index(shard_id)]
        full_rows = [self.full_output_sizes[i] for i in projections]
        expected = (sum(full_rows),) + ((self.full_in_features,) if param.ndim == 2 else ())
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {expected}")
        parts = [part.narrow(0, *self.row_shards[i]) for i, part in zip(projections, loaded.split(full_rows))]
        src = parts[0] if len(parts) == 1 else torch.cat(parts)
        start, count = (0, self.out_features) if shard_id is None else \
            (sum(self.output_sizes[:projections[0]]), self.output_sizes[projections[0]])
        if param.ndim == 2:
            if self.in_features != self.full_in_features:
                # the whole checkpoint rows' largest magnitudes: FP8 scales that do not depend on the rank count
                if self.row_amax is None:
                    self.row_amax = torch.zeros(self.out_features)
                self.row_amax.narrow(0, start, count).copy_(src.to(param.dtype).float().abs().amax(dim=1))
            src = src.narrow(1, *self.in_shard)
        elif self.in_features != self.full_in_features and self.tp.rank != 0:
            src = torch.zeros_like(src)   # a row-parallel bias: added once, by rank 0, before the all-reduce
        param.data.narrow(0, start, count).copy_(src)

    def load_gguf(self, loaded: GGUFWeight | ExpandedWeight | GGUFSegment, shard_id: int | str | None = None) -> None:
        """Keep one projection's GGUF blocks, or its tensor of another type dequantized at load (``shard_id``; None:
        every projection, the merged matrix) for :class:`GGUFLinearMethod`, checked against the checkpoint's full
        shape; or a :class:`GGUFSegment` built already, of this rank's rows, held as it is (a tied LM head shares the
        embedding's). With several ranks each projection keeps the rank's rows (``row_shards``: whole rows of
        blocks) and columns (``in_shard``: whole blocks, else ``ValueError`` naming the sizes), in memory of its own
        (:func:`~kv8.quant.gguf_blocks.shard_weight`)."""
        if not isinstance(self.method, GGUFLinearMethod):
            raise ValueError(f"holds GGUF blocks, but the layer's method is {self.method.name!r}, not 'gguf'")
        if isinstance(loaded, GGUFSegment):
            if shard_id is not None or len(self.output_sizes) > 1 or loaded.shape != (self.out_features,
                                                                                        self.in_features):
                raise ValueError(f"a shared GGUF segment of shape {loaded.shape} is one projection's rows of this "
                                 f"rank; this layer holds {self.output_sizes} x {self.in_features}")
            self.gguf_parts[0] = loaded
            return
        projections = range(len(self.full_output_sizes)) if shard_id is None else [self.shard_index(shard_id)]
        expected = (sum(self.full_output_sizes[i] for i in projections), self.full_in_features)
        if loaded.shape != expected:
            raise ValueError(f"has shape {loaded.shape}, the model expects {expected}")
        if isinstance(loaded, GGUFWeight) and not block_aligned(self.in_shard, loaded.qtype):
            values = BLOCK_VALUES[loaded.qtype]
            raise ValueError(f"is {loaded.qtype} blocks of {values} values; {type(self).__name__} splits its "
                             f"in_features={self.full_in_features} over tensor_parallel_size={self.tp.size} into "
                             f"{self.in_features} columns per rank, not whole blocks: use a tensor_parallel_size that "
                             f"divides its {self.full_in_features // values} blocks per row")
        row = 0
        for i in projections:
            if self.is_sharded:
                first, count = self.row_shards[i]
                self.gguf_parts[i] = shard_weight(loaded, (row + first, count), self.in_shard)
            elif len(projections) == 1:
                self.gguf_parts[i] = loaded
            elif isinstance(loaded, GGUFWeight):
                self.gguf_parts[i] = replace(loaded, blocks=loaded.blocks.narrow(0, row, self.full_output_sizes[i]))
            else:
                self.gguf_parts[i] = replace(loaded, weight=loaded.weight.narrow(0, row, self.full_output_sizes[i]))
            row += self.full_output_sizes[i]

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        shards = "" if not self.is_sharded else f", rank={self.tp.rank}/{self.tp.size}"
        return (f"in_features={self.in_features}, output_sizes={self.output_sizes}, "
                f"bias={self.has_bias}, "
                f"method={self.method.name}{shards}")


class Linear(LinearBase):
    """One projection ``[in_features] -> [out_features]``, replicated, its weights as loaded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: DenseBackend) -> None:
        super().__init__(in_features, [out_features], bias, backend, quantize=False)


class RowParallelLinear(LinearBase):
    """``[in_features] -> [out_features]`` whose input is split over the ranks (o_proj after the rank's heads,
    down_proj after its MLP columns): each rank multiplies its columns, one all-reduce sums the parts."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: DenseBackend) -> None:
        super().__init__(in_features, [out_features], bias, backend, in_shard=split_evenly(in_features, shard_group()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)                          # [..., out_features]: this rank's part
        return self.tp.all_reduce(out) if self.is_sharded else out


class MergedLinear(LinearBase):
    """Projections of one input side by side (gate and up: shards 0 and 1); split the output with
    ``output_sizes``. Column-parallel: each rank holds ``1 / N`` of every projection's rows."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, backend: DenseBackend) -> None:
        tp = shard_group()
        super().__init__(in_features, output_sizes, bias, backend, [split_evenly(n, tp) for n in output_sizes])

    def shard_index(self, shard_id: int | str | None) -> int:
        if isinstance(shard_id, int) and 0 <= shard_id < len(self.output_sizes):
            return shard_id
        raise ValueError(f"MergedLinear has shards 0..{len(self.output_sizes) - 1}, not {shard_id!r}")


class GateUpLinear(MergedLinear):
    """The gate and up projections of a gated MLP and the activation that joins them: ``forward(x)`` is
    ``act_fn([gate | up])``, ``[..., intermediate_size]`` (this rank's columns), e.g. ``silu(gate) * up``.

    The packed method fuses :class:`~kv8.layers.activation.SiluAndMul` into the projection (``fuses_silu``): the
    weights are packed with gate and up rows interleaved by 16 and the kernel's epilogue applies the activation,
    with the roundings of the unfused pair, so the result is bit-identical to ``act_fn(projection)``; calling
    the method's plain ``apply`` still gives ``[gate | up]``. Other activations and the torch method run the
    projection, then ``act_fn``. Shards 0 (gate) and 1 (up), as :class:`MergedLinear`.
    """

    packed_half: int   # rows of each half of the interleaved packed matrix (I rounded up to 16), packed method

    def __init__(self, in_features: int, intermediate_size: int, bias: bool, backend: DenseBackend,
                 act_fn: nn.Module) -> None:
        super().__init__(in_features, [intermediate_size, intermediate_size], bias, backend)
        self.act_fn = act_fn
        self.fuses_silu = isinstance(act_fn, SiluAndMul) and isinstance(self.method, PackedBF16LinearMethod)
        self.packed_half = -(-self.output_sizes[0] // 16) * 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply_gated(self, x)


class QKVLinear(LinearBase):
    """q, k and v projections as one matrix: output ``[..., (Hq + 2 Hkv) * D]`` = ``[q | k | v]``.

    ``num_heads`` / ``num_kv_heads`` are this rank's heads (the model's with one rank); ``kv_head_start`` is
    the model's index of its first KV head."""

    SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 backend: DenseBackend) -> None:
        tp = shard_group()
        (q0, hq), (k0, hkv) = split_evenly(num_heads, tp), kv_head_shard(num_kv_heads, tp)
        d = head_dim
        super().__init__(hidden_size, [num_heads * d, num_kv_heads * d, num_kv_heads * d], bias, backend,
                         [(q0 * d, hq * d), (k0 * d, hkv * d), (k0 * d, hkv * d)])
        self.head_dim, self.num_heads, self.num_kv_heads, self.kv_head_start = d, hq, hkv, k0

    def shard_index(self, shard_id: int | str | None) -> int:
        if shard_id in self.SHARDS:
            return self.SHARDS.index(shard_id)
        raise ValueError(f"QKVLinear has shards 'q', 'k', 'v', not {shard_id!r}")
