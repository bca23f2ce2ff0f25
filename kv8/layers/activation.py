"""SiLU-and-multiply over a merged gate/up projection: ``[T, 2I] = [gate | up] -> silu(gate) * up [T, I]``.

The torch path is :func:`silu_mul_reference`; the packed_bf16 path (:meth:`DenseKernels.silu_mul`, one pass,
bf16 only) rounds where torch does and differs only in the last bits of exp (at most one bf16 step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kv8.layers.dense_kernels import DenseBackend

__all__ = ["SiluAndMul", "silu_mul_reference"]


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
