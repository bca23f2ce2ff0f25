"""RMSNorm with the residual add fused in: ``forward(x, residual) -> (norm(h), h)`` with ``h = x + residual``.

Shapes: ``x``, ``residual`` and both outputs ``[T, E]``; ``weight [E]``. ``h`` is the residual stream the next
norm adds to (one add in x's dtype); ``norm(h) = weight * (h / rms(h))`` with the normalisation in float32 and
one rounding to x's dtype before the weight multiplies, as Hugging Face computes it.

The torch path is :func:`rmsnorm_reference`; the packed_bf16 path (:meth:`DenseKernels.rmsnorm`, one pass)
rounds at the same places and differs from it only in the order of a row's sum of squares (at most one bf16
step). ``residual=None`` (the first layer) means ``h = x``.

:class:`GemmaRMSNorm` is Gemma's convention, ``norm(h) = (h / rms(h)) * (1 + weight)``: checkpoints store
``weight`` as an offset from 1 (zeros initialise to the identity), and the normalised value is multiplied by
``1 + weight`` in float32 and rounded to x's dtype once, after the multiply (Llama rounds before it). The +1 is
added in the forward, not folded into the stored weight, because folding it into a bf16 parameter would round
``1 + w`` to 8 bits where Hugging Face keeps it in float32. Reference: :func:`gemma_rmsnorm_reference`; it runs
on every dense backend (the packed kernel implements the Llama rounding).
"""

from __future__ import annotations

import torch
from torch import nn

from kv8.layers.dense_backend import DenseBackend

__all__ = ["GemmaRMSNorm", "RMSNorm", "gemma_rmsnorm_reference", "rmsnorm_reference"]


def rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = x + residual`` (or x), in plain torch."""
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(h.dtype), h


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: DenseBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.kernels = backend.kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is not None:
            return self.kernels.rmsnorm(x, residual, self.weight, self.eps)
        return rmsnorm_reference(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, kernels={self.kernels is not None}"


def gemma_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = x + residual`` (or x) and Gemma's ``(1 + weight)`` scale, in plain torch."""
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (hf * (1.0 + weight.float())).to(h.dtype), h


class GemmaRMSNorm(nn.Module):
    """:class:`RMSNorm`'s interface with Gemma's ``(1 + weight)`` convention; ``weight [dim]`` as checkpoints
    store it (an offset from 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return gemma_rmsnorm_reference(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, weight=1+w"


def norm_per_head(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a norm over ``D`` to each head of ``x [T, H, D]`` (QK-norm: Qwen3, Gemma 3)."""
    t, h, d = x.shape
    return norm(x.reshape(t * h, d))[0].view(t, h, d)
