"""kv8's dense CPU kernels (``csrc/dense/dense.cpp``, AVX-512 BF16 and VBMI) through ctypes.

:class:`DenseKernels` wraps the C ABI: ``pack`` / ``linear`` (a bf16 matrix in a packed layout that the
kernel streams while prefetching the next panels; multiplied with AMX tiles where the CPU has AMX-BF16, else
with AVX-512 ``vdpbf16ps``: :attr:`DenseKernels.amx`; ``pack_fp8`` and ``linear(..., scale=)``: the same for
E4M3 codes with a scale per row, decoded to bf16 on the fly), ``rmsnorm`` (residual add + RMSNorm in one pass),
``silu_mul`` (SiLU(gate) * up) and ``rope_qkv`` (RoPE of q and k read straight from a packed q/k/v
projection, v copied out beside them); and ``argmax`` (rows of float32 logits, for the sampler). Every method
checks dtypes and shapes and raises ``ValueError``; every dense kernel takes bf16 and returns new contiguous bf16
tensors. The layers that use them, each beside its plain torch reference, are in :mod:`kv8.layers.linear`,
:mod:`~kv8.layers.norm`, :mod:`~kv8.layers.activation` and :mod:`~kv8.layers.rotary`; the sampler's choice of
argmax is :func:`kv8.engine.sampler.select_argmax`; whether a model's layers use them is its
:class:`kv8.layers.dense_backend.DenseBackend`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kv8.kernels.build import KernelUnavailable, build_shared_library

__all__ = ["DenseKernels", "load_dense_kernels"]

SOURCE = Path(__file__).parent / "csrc" / "dense" / "dense.cpp"

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


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
        lib.kv8_linear.argtypes = [_P, _L, _L, _P, _L, _P, _P, _I, _I, _I]
        lib.kv8_linear.restype = _I
        lib.kv8_linear_fp8.argtypes = [_P, _L, _L, _P, _L, _P, _P, _P, _I, _I, _I]
        lib.kv8_linear_fp8.restype = _I
        lib.kv8_linear_amx_available.argtypes = []
        lib.kv8_linear_amx_available.restype = _I
        lib.kv8_rmsnorm.argtypes = [_P, _P, _P, _P, _F, _L, _L, _P, _I]
        lib.kv8_rmsnorm.restype = _I
        lib.kv8_silu_mul.argtypes = [_P, _L, _L, _P, _I]
        lib.kv8_silu_mul.restype = _I
        lib.kv8_rope_qkv.argtypes = [_P, _L, _L, _I, _I, _I, _P, _P, _P, _P, _P, _I]
        lib.kv8_rope_qkv.restype = _I
        lib.kv8_argmax_rows.argtypes = [_P, _L, _L, _P, _I]
        lib.kv8_argmax_rows.restype = _I
        if not lib.kv8_linear_available():
            raise KernelUnavailable("this CPU (or compiler) lacks AVX-512 BF16 or VBMI, which kv8's dense kernels need")
        self.path = path
        self._lib = lib
        # The linear layers' path, fixed for the life of this instance so that every row of a layer is computed
        # the same way at every batch size: AMX tiles where the CPU, the build and the OS allow them (K a
        # multiple of 32), else vdpbf16ps. The two sum in different orders, so they may differ in the last bit.
        self.amx = bool(lib.kv8_linear_amx_available())

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` bf16 -> its packed layout (1-D bf16; see ``csrc/dense/dense.cpp``)."""
        if weight.dtype != torch.bfloat16 or weight.ndim != 2:
            raise ValueError(f"weight must be a 2-D bfloat16 tensor, got {weight.dtype} {list(weight.shape)}")
        w = weight.contiguous()
        n, k = w.shape
        out = torch.empty(int(self._lib.kv8_linear_packed_size(n, k)), dtype=torch.bfloat16)
        if self._lib.kv8_linear_pack(w.data_ptr(), n, k, out.data_ptr()) != 0:
            raise ValueError(f"cannot pack a weight of shape {list(w.shape)}")
        return out

    def pack_fp8(self, codes: torch.Tensor) -> torch.Tensor:
        """E4M3 codes ``[N, K]`` (uint8) -> the FP8 packed layout (1-D uint8, ``kv8_linear_packed_size(N, K)``
        codes): the bf16 packed layout's order of values with each pair-row's 64 codes in the order the kernel's
        table decode turns into that layout (``decode_panels_fp8`` in ``csrc/dense/linear.h``)."""
        if codes.dtype != torch.uint8 or codes.ndim != 2:
            raise ValueError(f"codes must be a 2-D uint8 tensor, got {codes.dtype} {list(codes.shape)}")
        n, k = codes.shape
        np_, kp = -(-n // 32) * 32, k + (k % 2)
        padded = torch.nn.functional.pad(codes, (0, kp - k, 0, np_ - n))
        # [panel, column, pair-row, j] -> [panel, pair-row, 2 column + j]: the bf16 packed order
        rows = padded.view(np_ // 32, 32, kp // 2, 2).permute(0, 2, 1, 3).reshape(-1, 64)
        return rows[:, _FP8_BYTE_ORDER].reshape(-1).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None, gated: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` bf16 contiguous -> ``[M, out_features]`` bf16. ``gated``: ``packed`` holds gate and up
        rows interleaved by 16 (:meth:`interleave_gate_up`, then :meth:`pack`) and the result is
        ``silu(gate) * up``, ``out_features`` wide (bias, if any, interleaved alike, float32). ``scale`` (float32,
        one value per packed row): ``packed`` holds FP8 codes (:meth:`pack_fp8`) of ``W / scale``, and each sum is
        multiplied by its row's scale before the bias."""
        m, k = x.shape
        out = torch.empty(m, out_features, dtype=torch.bfloat16)
        b = 0 if bias is None else bias.data_ptr()
        if scale is not None:
            rc = self._lib.kv8_linear_fp8(x.data_ptr(), m, k, packed.data_ptr(), out_features, scale.data_ptr(), b,
                                          out.data_ptr(), torch.get_num_threads(), int(gated), int(self.amx))
        else:
            rc = self._lib.kv8_linear(x.data_ptr(), m, k, packed.data_ptr(), out_features, b, out.data_ptr(),
                                      torch.get_num_threads(), int(gated), int(self.amx))
        if rc != 0:
            raise ValueError(f"packed linear failed (error {rc}) for x {list(x.shape)}, N={out_features}")
        return out

    @staticmethod
    def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
        """``[gate | up]`` rows (a weight ``[2I, K]`` or a bias ``[2I]``) -> groups of 16 gate rows then the 16
        matching up rows, each half zero-padded to ``ceil(I / 16) * 16`` rows: the gated kernel's order."""
        if t.ndim not in (1, 2) or t.shape[0] % 2:
            raise ValueError(f"a gate/up weight or bias has an even number of rows, got {list(t.shape)}")
        gate, up = t.chunk(2, dim=0)
        i = gate.shape[0]
        ip = -(-i // 16) * 16
        pad = (0, 0) * (t.ndim - 1) + (0, ip - i)
        halves = [torch.nn.functional.pad(h, pad) for h in (gate, up)]
        return torch.stack([h.reshape(ip // 16, 16, *t.shape[1:]) for h in halves], dim=1).reshape(2 * ip,
                                                                                                 *t.shape[1:])

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


    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``torch.argmax(x, dim=-1)`` of ``x [B, V]`` float32 (int64 ``[B]``: the lowest index of each row's
        maximum) for rows without NaN; a NaN entry is never chosen (see ``csrc/dense/argmax.h``)."""
        if x.dtype != torch.float32 or x.ndim != 2 or x.shape[1] == 0:
            raise ValueError(f"x must be a 2-D float32 tensor with columns, got {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        rc = self._lib.kv8_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"argmax kernel failed (error {rc}) for x {list(x.shape)}")
        return out


# Byte b of an FP8 pair-row holds bf16 value _FP8_BYTE_ORDER[b] of the bf16 pair-row (the decode's lane order).
_FP8_BYTE_ORDER = torch.tensor([8 * (b // 16) + b % 8 + (0 if b % 16 < 8 else 32) for b in range(64)])


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

