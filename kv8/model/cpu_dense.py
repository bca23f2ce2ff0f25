"""The dense part of a decoder layer on the CPU in bf16 (``dense_kernels.cpp``): linear layers on pre-packed
weights, and the elementwise ops around them fused into single passes.

Linear layers (:class:`PackedLinear`).
A decode step multiplies one row per running sequence with every weight matrix, so its cost is reading the
weights; at 1-16 rows oneDNN's bf16 GEMMs stream them at ~14-17 GB/s here, the packed kernel (which
prefetches the next panels while one computes) at ~33-45 GB/s, and at prefill-sized inputs it is ~1.2x
faster (``benchmarks/bench_linear.py``, docs/benchmarks.md). The weights
are kept *only* in the packed layout (no second copy), and projections that read the same input are packed
together (q/k/v, gate/up), so a layer makes four calls instead of seven.

Elementwise ops (:class:`DenseKernels` ``rmsnorm`` / ``silu_mul`` / ``rope_qkv``): the residual add plus
RMSNorm, SiLU(gate) * up, and RoPE of q and k read straight from the packed q/k/v projection (v copied out
beside them) each take one pass over the data instead of 3-8 torch ops, and round to bf16 exactly where the
torch code they replace does (:func:`rmsnorm_reference`, :func:`silu_mul_reference`, :func:`rope_reference`),
so they differ from it only in the last bits of exp / the order of a row's sum of squares.

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

from kv8.config import DENSE_BACKENDS, check_dense_backend
from kv8.native import KernelUnavailable, build_shared_library

logger = logging.getLogger("kv8")

__all__ = ["DENSE_BACKENDS", "DenseKernels", "PackedLinear", "apply_rope", "linear_reference",
           "load_dense_kernels", "rmsnorm_reference", "rope_reference", "select_dense_backend", "silu_mul_reference"]

SOURCE = Path(__file__).with_name("dense_kernels.cpp")

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the packed kernel computes, in plain torch: float32 products and sums, one rounding to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = x + residual`` (or x): the model's torch path, which
    :meth:`DenseKernels.rmsnorm` replaces."""
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(h.dtype), h


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout), the model's torch path. x ``[T, H, D]``; cos/sin ``[T, 1, D]`` in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q and k from packed ``qkv [T, (Hq + 2 Hkv) D]``; cos/sin ``[T, D/2]`` float32."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    c = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(qkv.dtype)
    s = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(qkv.dtype)
    return (apply_rope(q.reshape(t, num_heads, head_dim), c, s),
            apply_rope(k.reshape(t, num_kv_heads, head_dim), c, s), v.reshape(t, num_kv_heads, head_dim).contiguous())


class DenseKernels:
    """The loaded library. Build with :func:`load_dense_kernels`."""

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
        lib.kv8_rmsnorm.argtypes = [_P, _P, _P, _P, _F, _L, _L, _P, _I]
        lib.kv8_rmsnorm.restype = _I
        lib.kv8_silu_mul.argtypes = [_P, _L, _L, _P, _I]
        lib.kv8_silu_mul.restype = _I
        lib.kv8_rope_qkv.argtypes = [_P, _L, _L, _I, _I, _I, _P, _P, _P, _P, _P, _I]
        lib.kv8_rope_qkv.restype = _I
        if not lib.kv8_linear_available():
            raise KernelUnavailable("this CPU (or compiler) has no AVX-512 BF16, which kv8's dense kernels need")
        self.path = path
        self._lib = lib

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` bf16 -> its packed layout (1-D bf16; see ``dense_kernels.cpp``)."""
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

    def rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(h), h)`` with ``h = x + residual`` (or x); x/residual ``[T, E]`` bf16, weight ``[E]`` bf16."""
        _check_bf16("x", x, 2)
        t, e = x.shape
        if weight.dtype != torch.bfloat16 or weight.shape != (e,):
            raise ValueError(f"weight must be bfloat16 [{e}], got {weight.dtype} {list(weight.shape)}")
        x = x.contiguous()
        h = x
        if residual is not None:
            _check_bf16("residual", residual, 2)
            if residual.shape != x.shape:
                raise ValueError(f"residual {list(residual.shape)} must match x {list(x.shape)}")
            residual = residual.contiguous()
            h = torch.empty_like(x)
        out = torch.empty_like(x)
        rc = self._lib.kv8_rmsnorm(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                                   0 if residual is None else h.data_ptr(), weight.contiguous().data_ptr(),
                                   float(eps), t, e, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rmsnorm kernel failed (error {rc}) for x {list(x.shape)}")
        return out, h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2I]`` bf16 -> ``[T, I]``."""
        _check_bf16("gate_up", gate_up, 2)
        t, two_i = gate_up.shape
        if two_i % 2:
            raise ValueError(f"gate_up has {two_i} columns; it must be [gate | up] of equal widths")
        gate_up = gate_up.contiguous()
        out = torch.empty(t, two_i // 2, dtype=torch.bfloat16)
        rc = self._lib.kv8_silu_mul(gate_up.data_ptr(), t, two_i // 2, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"silu_mul kernel failed (error {rc}) for {list(gate_up.shape)}")
        return out

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` rotated, v ``[T, Hkv, D]``, all contiguous, from packed
        ``qkv [T, (Hq + 2 Hkv) D]`` bf16; cos/sin ``[T, D/2]`` float32."""
        _check_bf16("qkv", qkv, 2)
        t, width = qkv.shape
        if width != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
            raise ValueError(f"qkv has {width} columns, expected (Hq + 2 Hkv) * D = ({num_heads} + 2 * "
                             f"{num_kv_heads}) * {head_dim} with an even head_dim")
        for name, c in (("cos", cos), ("sin", sin)):
            if c.dtype != torch.float32 or c.shape != (t, head_dim // 2):
                raise ValueError(f"{name} must be float32 [{t}, {head_dim // 2}], got {c.dtype} {list(c.shape)}")
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        q = torch.empty(t, num_heads, head_dim, dtype=torch.bfloat16)
        k = torch.empty(t, num_kv_heads, head_dim, dtype=torch.bfloat16)
        v = torch.empty(t, num_kv_heads, head_dim, dtype=torch.bfloat16)
        rc = self._lib.kv8_rope_qkv(qkv.data_ptr(), t, width, num_heads, num_kv_heads, head_dim, cos.data_ptr(),
                                    sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rope kernel failed (error {rc}) for qkv {list(qkv.shape)}")
        return q, k, v


def _check_bf16(name: str, x: torch.Tensor, ndim: int) -> None:
    if x.dtype != torch.bfloat16 or x.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D bfloat16 tensor, got {x.dtype} {list(x.shape)}")


_LOADED: list[DenseKernels] = []
_FAILED: list[KernelUnavailable] = []


def load_dense_kernels() -> DenseKernels:
    """Build (first use) and load the kernels; raises :class:`KernelUnavailable`. Success or failure is
    remembered for the life of the process."""
    if _FAILED:
        raise _FAILED[0]
    if not _LOADED:
        try:
            _LOADED.append(DenseKernels(build_shared_library(SOURCE, "native")))
        except KernelUnavailable as exc:
            _FAILED.append(exc)
            raise
    return _LOADED[0]


_auto_fallback_logged = False


def select_dense_backend(name: str, dtype: torch.dtype) -> str:
    """``"packed_bf16"`` or ``"torch"``. ``auto`` uses the kernels for bf16 models when they build and load (else
    says why once per process and uses torch); ``cpu`` raises :class:`KernelUnavailable` if they can't;
    models in other dtypes use torch."""
    global _auto_fallback_logged
    check_dense_backend(name, dtype)
    if name == "torch" or dtype != torch.bfloat16:
        return "torch"
    try:
        load_dense_kernels()
    except KernelUnavailable as exc:
        if name == "packed_bf16":
            raise
        if not _auto_fallback_logged:
            _auto_fallback_logged = True
            logger.warning("dense layers: using torch because kv8's CPU kernels are unavailable: %s", exc)
        return "torch"
    return "packed_bf16"


class PackedLinear(nn.Module):
    """One or more ``nn.Linear`` layers that read the same input, as one packed bf16 matrix.

    ``forward(x)`` returns ``[..., sum(out_features)]``: the layers' outputs side by side, in the order given
    (split with ``sizes``). The original weights are not kept.
    """

    def __init__(self, lib: DenseKernels, layers: Sequence[nn.Linear]) -> None:
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
