"""bf16 linear layers on pre-packed weights (``linear_kernels.cpp``): the decode-step GEMMs on the CPU.

A decode step multiplies one row per running sequence with every weight matrix, so its cost is reading the
weights; inside the model oneDNN's bf16 GEMMs stream them at ~10-20 GB/s here, the packed kernel at ~25-34
GB/s (``benchmarks/bench_linear.py``), and it is within ~10% of oneDNN for prefill-sized inputs. The weights
are kept *only* in the packed layout (no second copy), and projections that read the same input are packed
together (q/k/v, gate/up), so a layer makes four calls instead of seven.

Invariants: ``PackedLinear(x)`` equals ``x @ W.T + b`` computed with exact bf16 products, fp32 accumulation
and one rounding to bf16 -- up to the order of the fp32 additions -- for bf16 ``x`` of any number of rows;
each output row depends only on its own input row (the result does not depend on the batch it is in).
Plain torch reference: :func:`linear_reference`.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from kv8.config import LINEAR_BACKENDS
from kv8.native import KernelUnavailable, build_shared_library

logger = logging.getLogger("kv8")

__all__ = ["LINEAR_BACKENDS", "LinearKernels", "PackedLinear", "linear_reference", "load_linear_kernels",
           "select_linear_backend"]

SOURCE = Path(__file__).with_name("linear_kernels.cpp")

_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the packed kernel computes, in plain torch: float32 products and sums, one rounding to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class LinearKernels:
    """The loaded library. Build with :func:`load_linear_kernels`."""

    def __init__(self, path: Path) -> None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelUnavailable(f"cannot load {path}: {exc}") from exc
        lib.kv8_linear_available.argtypes = []
        lib.kv8_linear_available.restype = _I
        lib.kv8_linear_packed_size.argtypes = [_L, _L]
        lib.kv8_linear_packed_size.restype = _L
        lib.kv8_linear_pack.argtypes = [_P, _L, _L, _P]
        lib.kv8_linear_pack.restype = _I
        lib.kv8_linear.argtypes = [_P, _L, _L, _P, _L, _P, _P, _I]
        lib.kv8_linear.restype = _I
        if not lib.kv8_linear_available():
            raise KernelUnavailable("this CPU (or compiler) has no AVX-512 BF16, which the packed linear kernel needs")
        self.path = path
        self._lib = lib

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` bf16 -> its packed layout (1-D bf16; see ``linear_kernels.cpp``)."""
        if weight.dtype != torch.bfloat16 or weight.ndim != 2:
            raise ValueError(f"weight must be a 2-D bfloat16 tensor, got {weight.dtype} {list(weight.shape)}")
        w = weight.contiguous()
        n, k = w.shape
        out = torch.empty(int(self._lib.kv8_linear_packed_size(n, k)), dtype=torch.bfloat16)
        if self._lib.kv8_linear_pack(w.data_ptr(), n, k, out.data_ptr()) != 0:
            raise ValueError(f"cannot pack a weight of shape {list(w.shape)}")
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K]`` bf16 contiguous -> ``[M, out_features]`` bf16."""
        m, k = x.shape
        out = torch.empty(m, out_features, dtype=torch.bfloat16)
        if m == 0:
            return out
        rc = self._lib.kv8_linear(x.data_ptr(), m, k, packed.data_ptr(), out_features,
                                  0 if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"packed linear failed (error {rc}) for x {list(x.shape)}, N={out_features}")
        return out


_LOADED: list[LinearKernels] = []
_FAILED: list[KernelUnavailable] = []


def load_linear_kernels() -> LinearKernels:
    """Build (first use) and load the kernel; raises :class:`KernelUnavailable`. Success or failure is
    remembered for the life of the process."""
    if _FAILED:
        raise _FAILED[0]
    if not _LOADED:
        try:
            _LOADED.append(LinearKernels(build_shared_library(SOURCE, "native")))
        except KernelUnavailable as exc:
            _FAILED.append(exc)
            raise
    return _LOADED[0]


_auto_fallback_logged = False


def select_linear_backend(name: str, dtype: torch.dtype) -> str:
    """``"cpu_packed"`` or ``"torch"``. ``auto`` packs bf16 models when the kernel builds and loads (else
    says why once per process and uses torch); ``cpu_packed`` raises :class:`KernelUnavailable` if it can't;
    models in other dtypes use torch's linear layers."""
    global _auto_fallback_logged
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend={name!r} is not known; choose one of: {', '.join(LINEAR_BACKENDS)}")
    if name == "torch" or (name == "auto" and dtype != torch.bfloat16):
        return "torch"
    if name == "cpu_packed" and dtype != torch.bfloat16:
        raise ValueError(f"linear_backend='cpu_packed' needs dtype bfloat16, got {dtype}")
    try:
        load_linear_kernels()
    except KernelUnavailable as exc:
        if name == "cpu_packed":
            raise
        if not _auto_fallback_logged:
            _auto_fallback_logged = True
            logger.warning("linear layers: using torch's because the packed CPU kernel is unavailable: %s", exc)
        return "torch"
    return "cpu_packed"


class PackedLinear(nn.Module):
    """One or more ``nn.Linear`` layers that read the same input, as one packed bf16 matrix.

    ``forward(x)`` returns ``[..., sum(out_features)]``: the layers' outputs side by side, in the order given
    (split with ``sizes``). The original weights are not kept.
    """

    def __init__(self, lib: LinearKernels, layers: Sequence[nn.Linear]) -> None:
        super().__init__()
        if not layers:
            raise ValueError("PackedLinear needs at least one layer")
        in_features = {layer.in_features for layer in layers}
        if len(in_features) != 1:
            raise ValueError(f"layers packed together must share in_features, got {sorted(in_features)}")
        self.lib = lib
        self.in_features = in_features.pop()
        self.sizes = [layer.out_features for layer in layers]
        self.out_features = sum(self.sizes)
        weight = torch.cat([layer.weight.detach() for layer in layers], dim=0)
        self.register_buffer("packed", lib.pack(weight), persistent=False)
        bias = None
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat([layer.bias.detach().float() if layer.bias is not None
                              else torch.zeros(layer.out_features) for layer in layers]).contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"PackedLinear takes bfloat16 input, got {x.dtype}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {self.in_features}")
        lead = x.shape[:-1]
        out = self.lib.linear(x.reshape(-1, self.in_features).contiguous(), self.packed, self.out_features, self.bias)
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.sizes}, bias={self.bias is not None}"
