"""kv8's dense CPU kernels (``csrc/dense/dense.cpp``: AVX-512 BF16 and VBMI, or AVX2 + FMA + F16C) through ctypes.

:class:`DenseKernels` wraps the C ABI: ``pack`` / ``linear`` (a bf16 matrix in a packed layout that the
kernel streams while prefetching the next panels; multiplied with AMX tiles where the CPU has AMX-BF16, else
with AVX-512 ``vdpbf16ps``: :attr:`DenseKernels.amx`; on CPUs without AVX-512 BF16, fp32 FMA in AVX2 registers:
:attr:`DenseKernels.isa`; ``pack_fp8`` and ``linear(..., scale=)``: the same for E4M3 codes with a scale per row,
decoded on the fly), ``rmsnorm`` (residual add + RMSNorm in one pass),
``silu_mul`` (SiLU(gate) * up) and ``rope_qkv`` (RoPE of q and k read straight from a packed q/k/v
projection, v copied out beside them); ``gguf_linear`` (a linear layer on GGUF blocks read in place, the types of
:attr:`DenseKernels.gguf_types`, activations quantized to int8 per block, integer dot products with AVX2 ``maddubs``
or VNNI ``vpdpbusd``, :attr:`DenseKernels.gguf_path`: ``csrc/dense/gguf.h``) and
``gguf_dequantize`` (the same blocks to float32, for a GEMM over many rows; ``gguf_dequantize_packed``: to bf16 in
``pack``'s layout, for ``linear``); ``unpack`` (packed bf16 or FP8 weights
back to float32, a slab of rows at a time, for the float32 GEMM of long prefill chunks; :func:`unpack_reference` is
its plain torch definition); and ``argmax`` (rows of float32 logits,
for the sampler). Every method
checks dtypes and shapes and raises ``ValueError``; every dense kernel takes bf16 and returns new contiguous bf16
tensors (``gguf_dequantize``: uint8 blocks to a new float32 matrix).
The layers that use them, each beside its plain torch reference, are in :mod:`kv8.layers.linear`,
:mod:`~kv8.layers.norm`, :mod:`~kv8.layers.activation` and :mod:`~kv8.layers.rotary`; the sampler's choice of
argmax is :func:`kv8.engine.sampler.select_argmax`; whether a model's layers use them is its
:class:`kv8.layers.dense_backend.DenseBackend`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kv8 import envs
from kv8.kernels.cpu.abi import NativeLibrary, code_table
from kv8.kernels.cpu.build import KernelUnavailable, build_shared_library

__all__ = ["FP8_REGISTER_ROWS", "DenseKernels", "describe_dense_kernels", "load_dense_kernels", "unpack_reference"]

#: FP8 weights on the vdpbf16ps path (``kv8_linear_fp8``): calls of up to this many rows decode each pair-row of codes
#: in registers for every block of rows, longer calls decode a few panels at a time into a buffer, once per call. The
#: same bits either way; the fixed rule, measured on an AMD EPYC (Zen 5): in registers 1.3x the buffer at 32 rows,
#: 1.06x at 192. CPUs differ (on an Intel Xeon without AMX the buffer wins from 32 rows): ``dense_backend="auto"``
#: times both per machine (:mod:`kv8.layers.tuning`, :attr:`kv8.layers.dense_backend.DenseBackend.fp8_register_rows`).
FP8_REGISTER_ROWS = 192

SOURCE = Path(__file__).parent / "csrc" / "dense" / "dense.cpp"

# ------------------------------------------------------------------------------------------------
# The argument structs (csrc/dense/abi.h), checked against the library's layout at load (kv8.kernels.cpu.abi).
# ------------------------------------------------------------------------------------------------

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class PackCall(ctypes.Structure):
    """``kv8_pack_call``: one bf16 weight matrix into the packed layout."""

    _fields_ = [("weight", _P), ("packed", _P), ("out_features", _I64), ("in_features", _I64)]


class LinearCall(ctypes.Structure):
    """``kv8_linear_call``: one linear layer on packed weights (bf16, or E4M3 codes with ``scale``)."""

    _fields_ = [
        ("x", _P), ("packed", _P), ("scale", _P), ("bias", _P), ("out", _P), ("rows", _I64), ("in_features", _I64),
        ("out_features", _I64), ("num_threads", _I32), ("gated", _I32), ("use_amx", _I32),
        ("fp8_register_rows", _I32),
    ]


class RmsNormCall(ctypes.Structure):
    """``kv8_rmsnorm_call``: residual add + RMSNorm of ``rows`` rows."""

    _fields_ = [
        ("x", _P), ("residual", _P), ("residual_out", _P), ("weight", _P), ("out", _P), ("rows", _I64),
        ("hidden", _I64), ("eps", ctypes.c_float), ("num_threads", _I32),
    ]


class SiluMulCall(ctypes.Structure):
    """``kv8_silu_mul_call``: SiLU(gate) * up of ``rows`` rows."""

    _fields_ = [("gate_up", _P), ("out", _P), ("rows", _I64), ("intermediate", _I64), ("num_threads", _I32)]


class RopeCall(ctypes.Structure):
    """``kv8_rope_call``: RoPE of q and k read from packed q/k/v rows, v copied out."""

    _fields_ = [
        ("qkv", _P), ("cos", _P), ("sin", _P), ("q_out", _P), ("k_out", _P), ("v_out", _P), ("rows", _I64),
        ("row_stride", _I64), ("num_heads", _I32), ("num_kv_heads", _I32), ("head_dim", _I32), ("num_threads", _I32),
    ]


class ArgmaxCall(ctypes.Structure):
    """``kv8_argmax_call``: the argmax of each row of float32 logits."""

    _fields_ = [("x", _P), ("out", _P), ("rows", _I64), ("cols", _I64), ("num_threads", _I32)]


class GGUFLinearCall(ctypes.Structure):
    """``kv8_gguf_linear_call``: one linear layer on GGUF blocks (``csrc/dense/gguf.h``; the types: ``gguf_types``)."""

    _fields_ = [
        ("x", _P), ("blocks", _P), ("bias", _P), ("out", _P), ("rows", _I64), ("in_features", _I64),
        ("out_features", _I64), ("qtype", _I32), ("num_threads", _I32), ("path", _I32),
    ]


class GGUFDequantizeCall(ctypes.Structure):
    """``kv8_gguf_dequantize_call``: GGUF blocks to float32 (``csrc/dense/gguf.h``)."""

    _fields_ = [("blocks", _P), ("out", _P), ("rows", _I64), ("in_features", _I64), ("qtype", _I32),
                ("num_threads", _I32)]


class GGUFPackCall(ctypes.Structure):
    """``kv8_gguf_pack_call``: GGUF blocks to bf16 in the packed layout (``csrc/dense/gguf_pack.h``)."""

    _fields_ = [("blocks", _P), ("out", _P), ("rows", _I64), ("in_features", _I64), ("first_panel", _I64),
                ("panels", _I64), ("qtype", _I32), ("gated", _I32), ("num_threads", _I32)]


class UnpackCall(ctypes.Structure):
    """``kv8_unpack_call``: rows of packed weights back to float32 (``csrc/dense/unpack.h``)."""

    _fields_ = [("packed", _P), ("scale", _P), ("out", _P), ("first", _I64), ("rows", _I64), ("in_features", _I64),
                ("num_threads", _I32)]


class DenseKernels(NativeLibrary):
    """The loaded library. Build with :func:`load_dense_kernels`. Every method checks dtypes and shapes; what the
    C side still refuses raises ``ValueError`` with the library's message."""

    STRUCTS = (("kv8_pack_call", PackCall), ("kv8_linear_call", LinearCall), ("kv8_rmsnorm_call", RmsNormCall),
               ("kv8_silu_mul_call", SiluMulCall), ("kv8_rope_call", RopeCall), ("kv8_argmax_call", ArgmaxCall),
               ("kv8_gguf_linear_call", GGUFLinearCall), ("kv8_gguf_dequantize_call", GGUFDequantizeCall),
               ("kv8_gguf_pack_call", GGUFPackCall), ("kv8_unpack_call", UnpackCall))

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        #: the build's path: "avx512" (AVX-512 BF16 + VBMI, and AMX tiles where :attr:`amx`) or "avx2" (AVX2 + FMA +
        #: F16C, fp32 arithmetic; ``csrc/dense/avx2.h``)
        self.isa: str = self._bind("kv8_dense_isa", [], ctypes.c_char_p)().decode()
        if not self._bind("kv8_linear_available", [])() or self.isa not in _FP8_BYTE_ORDER:
            raise KernelUnavailable("this CPU (or compiler) has neither AVX-512 BF16 + VBMI nor AVX2 + FMA + F16C, one "
                                    "of which kv8's dense kernels need")
        self._bind("kv8_linear_packed_size", [ctypes.POINTER(PackCall)], _I64)
        self._bind_structs("kv8_linear_pack", PackCall)
        self._bind_structs("kv8_linear", LinearCall)
        self._bind_structs("kv8_linear_fp8", LinearCall)
        self._bind_structs("kv8_rmsnorm", RmsNormCall)
        self._bind_structs("kv8_silu_mul", SiluMulCall)
        self._bind_structs("kv8_rope_qkv", RopeCall)
        self._bind_structs("kv8_argmax_rows", ArgmaxCall)
        self._bind_structs("kv8_gguf_linear", GGUFLinearCall)
        self._bind_structs("kv8_gguf_dequantize", GGUFDequantizeCall)
        self._bind_structs("kv8_gguf_dequantize_packed", GGUFPackCall)
        self._bind_structs("kv8_unpack", UnpackCall)
        self._bind_structs("kv8_unpack_fp8", UnpackCall)
        #: the GGUF block types :meth:`gguf_linear` reads (``gguf.GGMLQuantizationType`` names -> the library's codes),
        #: empty where this build has no AVX2 path for them (``csrc/dense/gguf.h``)
        self.gguf_types: dict[str, int] = (code_table(self._lib.kv8_gguf_type_name)
                                           if self._bind("kv8_gguf_linear_available", [])() else {})
        available = self._bind("kv8_gguf_path_available", [ctypes.c_int])
        #: the paths of :meth:`gguf_linear` this build has, narrowest first (``csrc/dense/gguf.h``): "avx2"
        #: (``maddubs``), "vnni256" (``vpdpbusd`` on ymm), "vnni512" (AVX-512 VNNI, 16 rows a zmm) -> their codes
        self.gguf_paths: dict[str, int] = {name: code for name, code in code_table(self._lib.kv8_gguf_path_name).items()
                                           if available(code)} if self.gguf_types else {}
        # Every path computes the same bits (gguf.h), so the choice is speed alone: the widest this build has
        # (vnni512 measured fastest on an AVX-512 VNNI Xeon: docs/benchmarks.md, "GGUF blocks kept quantized"), or
        # the one $KV8_GGUF_KERNEL names.
        self._gguf_path = ""
        forced = envs.gguf_kernel()
        if forced is not None and forced not in self.gguf_paths:
            raise ValueError(f"{envs.GGUF_KERNEL_ENV}={forced!r}: this build's GGUF kernel has the paths "
                             f"{list(self.gguf_paths) or 'none (no AVX2 + FMA + F16C)'} (or auto)")
        if self.gguf_paths:
            self.gguf_path = forced or list(self.gguf_paths)[-1]
        # The linear layers' path, fixed for the life of this instance so that every row of a layer is computed
        # the same way at every batch size: AMX tiles where the CPU, the build and the OS allow them (K a
        # multiple of 32), else vdpbf16ps. The two sum in different orders, so they may differ in the last bit.
        self.amx = bool(self._bind("kv8_linear_amx_available", [])())

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` bf16 -> its packed layout (1-D bf16; see ``csrc/dense/dense.cpp``)."""
        if weight.dtype != torch.bfloat16 or weight.ndim != 2:
            raise ValueError(f"weight must be a 2-D bfloat16 tensor, got {weight.dtype} {list(weight.shape)}")
        w = weight.contiguous()
        call = PackCall(w.data_ptr(), None, w.shape[0], w.shape[1])
        size = self._lib.kv8_linear_packed_size(ctypes.byref(call))
        if size < 0:
            raise ValueError(f"cannot pack a weight of shape {list(w.shape)}")
        out = torch.empty(size, dtype=torch.bfloat16)
        call.packed = out.data_ptr()
        rc = self._lib.kv8_linear_pack(ctypes.byref(call))
        if rc != 0:
            raise self.error(rc, f"packing a weight of shape {list(w.shape)}")
        return out

    def pack_fp8(self, codes: torch.Tensor) -> torch.Tensor:
        """E4M3 codes ``[N, K]`` (uint8) -> the FP8 packed layout (1-D uint8, ``kv8_linear_packed_size(N, K)``
        codes): the bf16 packed layout's order of values with each pair-row's 64 codes in the order this build's
        decode reads them (AVX-512: the table decode's, ``decode_panels_fp8`` in ``csrc/dense/linear.h``; AVX2: the
        bf16 layout's own order, ``csrc/dense/avx2.h``)."""
        if codes.dtype != torch.uint8 or codes.ndim != 2:
            raise ValueError(f"codes must be a 2-D uint8 tensor, got {codes.dtype} {list(codes.shape)}")
        n, k = codes.shape
        np_, kp = -(-n // 32) * 32, k + (k % 2)
        padded = torch.nn.functional.pad(codes, (0, kp - k, 0, np_ - n))
        # [panel, column, pair-row, j] -> [panel, pair-row, 2 column + j]: the bf16 packed order
        rows = padded.view(np_ // 32, 32, kp // 2, 2).permute(0, 2, 1, 3).reshape(-1, 64)
        return rows[:, _FP8_BYTE_ORDER[self.isa]].reshape(-1).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None, gated: bool = False, scale: torch.Tensor | None = None,
               fp8_register_rows: int = FP8_REGISTER_ROWS) -> torch.Tensor:
        """``x [M, K]`` bf16 contiguous -> ``[M, out_features]`` bf16. ``gated``: ``packed`` holds gate and up
        rows interleaved by 16 (:meth:`interleave_gate_up`, then :meth:`pack`) and the result is
        ``silu(gate) * up``, ``out_features`` wide (bias, if any, interleaved alike, float32). ``scale`` (float32,
        one value per packed row): ``packed`` holds FP8 codes (:meth:`pack_fp8`) of ``W / scale``, and each sum is
        multiplied by its row's scale before the bias; ``fp8_register_rows`` (>= 0, :data:`FP8_REGISTER_ROWS`) says
        up to how many rows the vdpbf16ps path decodes the codes in registers (the same bits either way)."""
        if fp8_register_rows < 0:
            raise ValueError(f"fp8_register_rows={fp8_register_rows} must be >= 0")
        m, k = x.shape
        out = torch.empty(m, out_features, dtype=torch.bfloat16)
        call = LinearCall(x.data_ptr(), packed.data_ptr(), None if scale is None else scale.data_ptr(),
                          None if bias is None else bias.data_ptr(), out.data_ptr(), m, k, out_features,
                          torch.get_num_threads(), int(gated), int(self.amx), fp8_register_rows)
        entry = self._lib.kv8_linear if scale is None else self._lib.kv8_linear_fp8
        self.invoke(entry, f"packed linear for x {list(x.shape)}, N={out_features}", call)
        return out

    def unpack(self, packed: torch.Tensor, first: int, rows: int, in_features: int,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``first .. first + rows`` of the matrix :meth:`pack` (or, with ``scale``, :meth:`pack_fp8`) packed, as a
        new float32 ``[rows, in_features]`` (``csrc/dense/unpack.h``): bf16 values widened (exact); FP8 codes decoded
        and multiplied by their row's ``scale`` (float32, one per packed row: one float32 rounding). The values of
        :func:`unpack_reference`, bit for bit. ``first`` is a multiple of the layout's 32-row panels, and the rows lie
        within the packed matrix (its padding rows are zero)."""
        fp8 = scale is not None
        kp = in_features + in_features % 2
        dtype, width = (torch.uint8, 1) if fp8 else (torch.bfloat16, 2)
        if (first % 32 or first < 0 or rows < 0 or in_features <= 0 or packed.dtype != dtype or packed.ndim != 1
                or packed.numel() % (32 * kp) or -(-(first + rows) // 32) * 32 * kp > packed.numel()):
            raise ValueError(f"unpack: first={first} must be a multiple of 32 and packed a 1-D {dtype} tensor of whole "
                             f"panels of 32 x {kp} holding rows {first}..{first + rows}, got {packed.dtype} "
                             f"{list(packed.shape)}")
        if scale is not None and (scale.dtype != torch.float32 or scale.ndim != 1 or scale.numel() < first + rows
                                  or not scale.is_contiguous()):
            raise ValueError(f"unpack: scale must be a contiguous 1-D float32 tensor of at least {first + rows} rows, "
                             f"got {scale.dtype} {list(scale.shape)}")
        if not packed.is_contiguous():
            raise ValueError("unpack: packed must be contiguous")
        out = torch.empty(rows, in_features, dtype=torch.float32)
        call = UnpackCall(packed.data_ptr(), None if scale is None else scale.data_ptr(), out.data_ptr(), first, rows,
                          in_features, torch.get_num_threads())
        self.invoke(self._lib.kv8_unpack_fp8 if fp8 else self._lib.kv8_unpack,
                    f"unpack of rows {first}..{first + rows} of {list(packed.shape)}, K={in_features}", call)
        return out

    @property
    def gguf_path(self) -> str:
        """The path :meth:`gguf_linear` runs, one of :attr:`gguf_paths` ("" where the build has none). Settable (the
        tests and benchmarks run each path); ``ValueError`` for a path this build does not have."""
        return self._gguf_path

    @gguf_path.setter
    def gguf_path(self, path: str) -> None:
        if path not in self.gguf_paths:
            raise ValueError(f"GGUF kernel path {path!r} is not in this build; it has: "
                             f"{list(self.gguf_paths) or 'none (no AVX2 + FMA + F16C)'}")
        self._gguf_path = path

    def _gguf_code(self, qtype: str) -> int:
        """The C code of GGUF block type ``qtype``; ``ValueError`` naming the types this build reads otherwise."""
        if qtype not in self.gguf_types:
            raise ValueError(f"GGUF block type {qtype!r} has no kernel in this build; it has: "
                             f"{sorted(self.gguf_types) or 'none (no AVX2 + FMA + F16C)'}")
        return self.gguf_types[qtype]

    def gguf_linear(self, x: torch.Tensor, blocks: torch.Tensor, qtype: str, out_features: int,
                    bias: torch.Tensor | None, path: str | None = None) -> torch.Tensor:
        """``x [M, K]`` bf16 -> ``[M, out_features]`` bf16 ``= x @ W.T (+ bias)`` with ``W`` held as GGUF blocks of
        type ``qtype`` (one of :attr:`gguf_types`): ``blocks [out_features, row bytes]`` uint8 (``K / block values *
        block bytes``), the file's
        bytes in the kernel's order (:func:`kv8.quant.gguf_blocks.group_blocks`). The activations are quantized to
        int8 per block of 32 (``csrc/dense/gguf.h``: the error bound); ``bias`` is float32 ``[out_features]`` or
        None. Runs on ``path`` (one of :attr:`gguf_paths`; None: :attr:`gguf_path`, the process's default); every path
        gives the same bits (the dense tuner chooses one per block type and machine: kv8.layers.tuning)."""
        code = self._gguf_code(qtype)
        if path is not None and path not in self.gguf_paths:
            raise ValueError(f"GGUF kernel path {path!r} is not in this build; it has: "
                             f"{list(self.gguf_paths) or 'none (no AVX2 + FMA + F16C)'}")
        _check_bf16("x", x, 2)
        m, k = x.shape
        if (blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[0] != out_features
                or not blocks.is_contiguous()):
            raise ValueError(f"blocks must be a contiguous uint8 [{out_features}, row bytes] tensor, got "
                             f"{blocks.dtype} {list(blocks.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
            raise ValueError(f"bias must be float32 [{out_features}], got {bias.dtype} {list(bias.shape)}")
        x = x.contiguous()
        out = torch.empty(m, out_features, dtype=torch.bfloat16)
        call = GGUFLinearCall(x.data_ptr(), blocks.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), m, k, out_features, code, torch.get_num_threads(),
                              self.gguf_paths[path or self.gguf_path])
        self.invoke(self._lib.kv8_gguf_linear, f"GGUF {qtype} linear for x {list(x.shape)}, N={out_features}", call)
        return out

    def gguf_dequantize(self, blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
        """``blocks [N, row bytes]`` uint8 of type ``qtype`` in the kernel's order (as for
        :meth:`gguf_linear`) -> a new float32 ``[N, in_features]``: the values of
        :func:`kv8.quant.gguf_blocks.dequantize_blocks`, bit for bit."""
        code = self._gguf_code(qtype)
        _check_blocks(blocks)
        n = blocks.shape[0]
        values, size = _GGUF_BLOCK_VALUES[qtype], _GGUF_BLOCK_BYTES[qtype]
        if in_features % values == 0 and blocks.shape[1] != in_features // values * size:
            raise ValueError(f"blocks [{n}, {blocks.shape[1]}] of {qtype} do not hold rows of {in_features} values")
        out = torch.empty(n, max(in_features, 0), dtype=torch.float32)   # K off the blocks: the C side refuses
        call = GGUFDequantizeCall(blocks.data_ptr(), out.data_ptr(), n, in_features, code,
                                  torch.get_num_threads())
        self.invoke(self._lib.kv8_gguf_dequantize,
                    f"GGUF {qtype} dequantize of blocks {list(blocks.shape)}, K={in_features}", call)
        return out

    def gguf_dequantize_packed(self, blocks: torch.Tensor, qtype: str, in_features: int, gated: bool = False,
                               first_panel: int = 0, panels: int | None = None) -> torch.Tensor:
        """The blocks of :meth:`gguf_dequantize` (``[N, row bytes]`` uint8 of type ``qtype``, the kernel's order) as
        bf16 in :meth:`pack`'s layout, panels ``first_panel .. first_panel + panels`` (default: to the last; 32 rows
        each, ``32 * in_features`` values a panel), in one pass (``csrc/dense/gguf_pack.h``): each value is
        :meth:`gguf_dequantize`'s float32 rounded to bf16, so that the result is bit for bit
        ``pack(gguf_dequantize(...).bfloat16())`` (with ``gated``, of :meth:`interleave_gate_up` of it: ``blocks``
        holds ``[gate; up]``, N even). Multiply it with :meth:`linear` (``gated`` alike)."""
        code = self._gguf_code(qtype)
        _check_blocks(blocks)
        n = blocks.shape[0]
        values, size = _GGUF_BLOCK_VALUES[qtype], _GGUF_BLOCK_BYTES[qtype]
        if in_features <= 0 or in_features % values or blocks.shape[1] != in_features // values * size:
            raise ValueError(f"blocks [{n}, {blocks.shape[1]}] of {qtype} do not hold rows of in_features="
                             f"{in_features} values (a positive multiple of {values})")
        if gated and n % 2:
            raise ValueError(f"gated: blocks hold [gate; up], an even number of rows, got {n}")
        total = -(-(n // 2) // 16) if gated else -(-n // 32)
        panels = total - first_panel if panels is None else panels
        if first_panel < 0 or panels < 0 or first_panel + panels > total:
            raise ValueError(f"panels {first_panel}..{first_panel + panels} are not within the {total} panels of the "
                             f"packed matrix of {n} rows{' (gated)' if gated else ''}")
        out = torch.empty(panels * 32 * in_features, dtype=torch.bfloat16)
        call = GGUFPackCall(blocks.data_ptr(), out.data_ptr(), n, in_features, first_panel, panels, code, int(gated),
                            torch.get_num_threads())
        self.invoke(self._lib.kv8_gguf_dequantize_packed,
                    f"GGUF {qtype} dequantize of blocks {list(blocks.shape)} to packed panels {first_panel}.."
                    f"{first_panel + panels}, K={in_features}", call)
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
        call = RmsNormCall(x.data_ptr(), None if residual is None else residual.data_ptr(),
                           None if residual is None else h.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(),
                           t, e, float(eps), torch.get_num_threads())
        self.invoke(self._lib.kv8_rmsnorm, f"rmsnorm of x {list(x.shape)}", call)
        return out, h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2I]`` bf16 -> ``[T, I]``."""
        _check_bf16("gate_up", gate_up, 2)
        t, two_i = gate_up.shape
        if two_i % 2:
            raise ValueError(f"gate_up has {two_i} columns; it must be [gate | up] of equal widths")
        gate_up = gate_up.contiguous()
        out = torch.empty(t, two_i // 2, dtype=torch.bfloat16)
        call = SiluMulCall(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads())
        self.invoke(self._lib.kv8_silu_mul, f"silu_mul of {list(gate_up.shape)}", call)
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
        call = RopeCall(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), t,
                        width, num_heads, num_kv_heads, head_dim, torch.get_num_threads())
        self.invoke(self._lib.kv8_rope_qkv, f"rope of qkv {list(qkv.shape)}", call)
        return q, k, v

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``torch.argmax(x, dim=-1)`` of ``x [B, V]`` float32 (int64 ``[B]``: the lowest index of each row's
        maximum) for rows without NaN; a NaN entry is never chosen (see ``csrc/dense/argmax.h``)."""
        if x.dtype != torch.float32 or x.ndim != 2 or x.shape[1] == 0:
            raise ValueError(f"x must be a 2-D float32 tensor with columns, got {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        call = ArgmaxCall(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
        self.invoke(self._lib.kv8_argmax_rows, f"argmax of x {list(x.shape)}", call)
        return out


# bytes and values per block (kv8.quant.gguf_blocks.BLOCK_BYTES / BLOCK_VALUES, which this layer cannot import; the
# tests compare them): the row bytes gguf_dequantize checks before the C side reads them
_GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}
_GGUF_BLOCK_VALUES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}

# kv8 info's words for each GGUF kernel path (csrc/dense/gguf.h)
_GGUF_PATH_WORDS = {"avx2": "AVX2 maddubs", "vnni256": "VNNI vpdpbusd on ymm",
                    "vnni512": "AVX-512 VNNI vpdpbusd, 16 rows a zmm"}

# Per path: byte b of an FP8 pair-row holds value _FP8_BYTE_ORDER[isa][b] of the bf16 pair-row (value 2 c + j: column
# c, k = 2 kk + j). AVX-512: the table decode's lane order; AVX2: the bf16 pair-row's own order (its decode sign-extends
# each code to the word that the value's bf16 has in the bf16 layout).

_FP8_BYTE_ORDER = {
    "avx512": torch.tensor([8 * (b // 16) + b % 8 + (0 if b % 16 < 8 else 32) for b in range(64)]),
    "avx2": torch.arange(64),
}


def _check_blocks(blocks: torch.Tensor) -> None:
    """GGUF blocks as the kernels read them (:meth:`DenseKernels.gguf_dequantize` and ``gguf_dequantize_packed``): a
    contiguous 2-D uint8 tensor, else ``ValueError``."""
    if blocks.dtype != torch.uint8 or blocks.ndim != 2 or not blocks.is_contiguous():
        raise ValueError(f"blocks must be a contiguous 2-D uint8 tensor, got {blocks.dtype} {list(blocks.shape)}")


def unpack_reference(packed: torch.Tensor, first: int, rows: int, in_features: int, scale: torch.Tensor | None = None,
                     isa: str = "avx512") -> torch.Tensor:
    """What :meth:`DenseKernels.unpack` computes, in plain torch: the panels of rows ``first .. first + rows`` put back
    in row order (``packed[p][kk][c][j] = W[32 p + c, 2 kk + j]``), as float32; with ``scale``, ``packed`` holds
    :meth:`DenseKernels.pack_fp8`'s codes in build ``isa``'s byte order, each decoded (torch's ``float8_e4m3fn``) and
    multiplied by its row's scale in float32."""
    kp = in_features + in_features % 2
    p0, p1 = first // 32, -(-(first + rows) // 32)
    if scale is None:
        panels = packed.view(-1, kp // 2, 32, 2)[p0:p1]          # (P, Kp/2, 32, 2): packed[p][kk][c][j]
        return panels.permute(0, 2, 1, 3).reshape(-1, kp)[:rows, :in_features].float()
    pair_rows = packed.view(-1, 64)[p0 * kp // 2:p1 * kp // 2]  # (P Kp/2, 64) in the build's byte order
    values = torch.empty_like(pair_rows)
    values[:, _FP8_BYTE_ORDER[isa]] = pair_rows                  # byte b holds bf16-order value _FP8_BYTE_ORDER[b]
    panels = values.view(-1, kp // 2, 32, 2)
    codes = panels.permute(0, 2, 1, 3).reshape(-1, kp)[:rows, :in_features]
    return codes.view(torch.float8_e4m3fn).float() * scale[first:first + rows, None]


def _check_bf16(name: str, x: torch.Tensor, ndim: int) -> None:
    if x.dtype != torch.bfloat16 or x.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D bfloat16 tensor, got {x.dtype} {list(x.shape)}")


_LOADED: dict[str, DenseKernels] = {}
_FAILED: dict[str, str] = {}   # the failure's message, once per march


def load_dense_kernels(march: str = "native") -> DenseKernels:
    """Build (first use) and load the kernels for ``-march=march`` (the engine: ``native``; tests also build
    ``x86-64-v3``, the AVX2 path, and ``x86-64-v2``, which has no path); raises :class:`KernelUnavailable`. Success
    or failure is remembered per ``march`` for the life of the process (a failure as its message: each call raises a
    new exception, so no caller's frames stay reachable from the remembered one)."""
    if not isinstance(march, str) or not march or any(c.isspace() for c in march):
        raise ValueError(f"march={march!r} must be a non-empty -march value without spaces")
    if march in _FAILED:
        raise KernelUnavailable(_FAILED[march])
    if march not in _LOADED:
        try:
            _LOADED[march] = DenseKernels(build_shared_library(SOURCE, march))
        except KernelUnavailable as exc:
            _FAILED[march] = str(exc)
            raise
    return _LOADED[march]



def describe_dense_kernels() -> str:
    """The dense kernels' path on this machine in words (``kv8 info``): ``avx512`` (AMX tiles or ``vdpbf16ps``),
    ``avx2`` (fp32 FMA), and the GGUF block kernel's types; or why they are unavailable."""
    try:
        lib = load_dense_kernels()
    except KernelUnavailable as exc:
        return f"unavailable: {str(exc).splitlines()[0]}"
    gguf = (f"; GGUF {' / '.join(lib.gguf_types)} blocks: int8 activations, {_GGUF_PATH_WORDS[lib.gguf_path]} "
            f"({lib.gguf_path} of {', '.join(lib.gguf_paths)})" if lib.gguf_types else "; no GGUF block kernel")
    if lib.isa == "avx512":
        return ("avx512 (AMX-BF16 tiles)" if lib.amx else "avx512 (AVX-512 BF16 vdpbf16ps)") + gguf
    return "avx2 (AVX2 + FMA + F16C: fp32 FMA on bf16 / FP8 weights)" + gguf
