"""FP8 weights (``quantization="fp8"``, vLLM's name): a linear layer's ``W [N, K]`` stored as E4M3 codes with one
float32 scale per output row, ``W ~ decode(codes) * scale[:, None]``.

``scale[n] = max_k |W[n, k]| / 448`` (448: E4M3's largest finite value), so each row's largest weight is a code
of magnitude 448 and nothing saturates; a row of zeros gets scale 1.0. Codes are
:meth:`kv8.quant.formats.FP8Format.encode` of ``W / scale`` (round to nearest even). The error of a weight is at
most half a step of its code (a relative 2^-4 for normal codes), far below what a row's rounding of the
activations to bf16 already allows for large rows, which is why the accuracy tests compare logits, not weights.
"""

from __future__ import annotations

import torch

from kv8.quant.formats import E4M3

__all__ = ["dequantize_fp8_rows", "quantize_fp8_rows"]


def quantize_fp8_rows(weight: torch.Tensor, row_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(codes [N, K] uint8 E4M3, scale [N] float32)``. ``row_amax``
    ([N], at least each row's own max |w|): the scales' basis instead of the rows' own maxima -- a tensor-parallel
    rank holding some columns of each row passes the whole rows' maxima, so every rank count gets the same
    codes and scales."""
    if weight.ndim != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantize_fp8_rows: weight must be a 2-D float tensor, got {weight.dtype} "
                         f"{list(weight.shape)}")
    w = weight.float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp8_rows: the weight has non-finite values")
    amax = w.abs().amax(dim=1)
    if row_amax is not None:
        if row_amax.shape != amax.shape or bool((row_amax.float() < amax).any()):
            raise ValueError(f"quantize_fp8_rows: row_amax {list(row_amax.shape)} must hold, per row, at least the "
                             f"row's largest magnitude")
        amax = row_amax.float()
    scale = torch.where(amax > 0, amax / E4M3.max_finite, torch.ones_like(amax))
    return E4M3.encode(w / scale[:, None]), scale.contiguous()


def dequantize_fp8_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode(codes) * scale[:, None]`` in float32, then ``dtype``: the weight the FP8 layer multiplies by."""
    return (E4M3.decode(codes) * scale[:, None]).to(dtype)
