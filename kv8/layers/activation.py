"""Gated activations over a merged gate/up projection: ``[T, 2I] = [gate | up] -> act(gate) * up [T, I]``.

* :class:`SiluAndMul` (Llama family): the torch path is :func:`silu_mul_reference`; the packed_bf16 path
  (:meth:`DenseKernels.silu_mul`, one pass, bf16 only) rounds where torch does and differs only in the last bits
  of exp (at most one bf16 step).
* :class:`GeluAndMul` (Gemma's GeGLU, ``hidden_activation: gelu_pytorch_tanh``): the tanh approximation of GELU.
  kv8's packed kernels have no GELU, so every backend runs :func:`gelu_tanh_mul_reference` (torch's fused
  ``gelu(approximate="tanh")``, what transformers runs); the linear layers around it still use the backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kv8.layers.dense_backend import DenseBackend

__all__ = ["GeluAndMul", "SiluAndMul", "gelu_tanh_mul_reference", "silu_mul_reference"]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim, in plain torch."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """No parameters."""

    def __init__(self, backend: DenseBackend) -> None:
        super().__init__()
        self.kernels = backend.kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up)
        return silu_mul_reference(gate_up)


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up = [gate | up]`` along the last dim, in plain torch."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluAndMul(nn.Module):
    """No parameters. Torch on every dense backend (see the module docstring)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_mul_reference(gate_up)
