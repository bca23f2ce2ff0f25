"""The dense backend of a model: whether its dense layers (linear, norm, activation, RoPE) run torch ops or kv8's
packed kernels (:mod:`kv8.kernels.cpu.dense`), chosen once, when the model loads.

:func:`select_dense_backend` turns the engine option ``dense_backend`` (checked by
:class:`kv8.engine.config.EngineConfig`) into a :class:`DenseBackend`: ``torch`` runs torch ops; ``torch_fp32`` too,
with the linear layers' weights widened to float32 at load; ``packed_bf16`` runs the kernels and needs a bf16
model. Here ``auto`` is the fixed rule: ``packed_bf16`` for bf16 models when the kernels build and load, else torch
(with one warning per process); the loader first asks :mod:`kv8.layers.tuning` for this machine's measured choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kv8.kernels.cpu.build import KernelUnavailable
from kv8.kernels.cpu.dense import FP8_REGISTER_ROWS, DenseKernels, load_dense_kernels
from kv8.platform import CPU, Platform

logger = logging.getLogger("kv8")

__all__ = ["DenseBackend", "GGUF_BF16_ROWS", "GGUF_DEQUANTIZE_ROWS", "GGUF_EXPANSIONS", "TORCH_BACKEND",
           "select_dense_backend"]

#: with ``quantization="gguf"``, the fixed rule's row count from which the packed backend dequantizes the blocks and
#: runs the float32 GEMM instead of the int8 kernel (``dense_backend="packed_bf16"``, ``KV8_TUNING=off``;
#: ``dense_backend="auto"`` times it against the int8 kernel at every row count, :mod:`kv8.layers.tuning`). Measured
#: on an AMD EPYC Zen 3 (AVX2, no VNNI), 32 SmolLM2-shaped Q4_1 layers, one thread's CPU time (the machine was
#: shared): int8 / dequantize+GEMM 0.76 at 16 rows, 0.99 at 24, 1.08 at 32, 1.67 at 64, 1.80 at 128. On an Intel
#: Xeon with AVX-512 VNNI the int8 kernel wins at every row count (docs/benchmarks.md, "GGUF blocks kept quantized").
GGUF_DEQUANTIZE_ROWS = 32

#: with ``quantization="gguf"``, what the blocks are dequantized to from a backend's switch on: ``"f32"`` (float32,
#: multiplied by torch's float32 GEMM, :func:`kv8.layers.linear.linear_f32`) or ``"bf16"`` (each value rounded to
#: bf16 in the packed kernel's layout and multiplied by it: AMX tiles where the CPU has them)
GGUF_EXPANSIONS = ("f32", "bf16")

#: the row count from which ``dense_backend="auto"``'s bf16 candidate dequantizes the blocks to bf16 instead of
#: running the int8 kernel. Measured on an Intel Xeon with AMX (family 6 model 207), 2 threads, 30 SmolLM2-shaped
#: Q4_1 layers (``bench_linear.py --rows 64,128,256,512,1024``, two runs), the int8 kernel's time over the bf16
#: expansion's: 0.97-0.98 at 64 rows, 1.38-1.79 at 128, 1.98-2.54 at 256 (docs/benchmarks.md, "GGUF blocks expanded
#: to bf16"). Where the expansion loses (no AMX), the tuner keeps the int8 kernel.
GGUF_BF16_ROWS = 128

_auto_fallback_logged = False


@dataclass(frozen=True)
class DenseBackend:
    """How the dense layers of a model compute: ``name`` is ``"torch"`` or ``"torch_fp32"`` (``kernels`` is None;
    the second holds the linear layers' weights in float32) or ``"packed_bf16"`` (``kernels`` is the loaded
    library). Each layer picks its implementation from it when it
    is constructed; nothing switches afterwards."""

    name: str    # "torch", "torch_fp32" or "packed_bf16"
    kernels: DenseKernels | None = None
    quantization: str | None = None   # the decoder's linear layers: None (as loaded), "fp8" or "gguf" (file blocks)
    # FP8 weights multiplied by torch._scaled_mm with FP8 activations (a GPU with FP8 tensor cores), instead of
    # dequantized once to the compute dtype
    fp8_scaled_mm: bool = False
    # packed_bf16: calls of at least this many rows multiply in float32 (0: never), chosen per machine by
    # kv8.layers.tuning. With the model's own bf16 weights the packed weight is widened a slab at a time
    # (:class:`kv8.layers.linear.PackedBF16LinearMethod`), with FP8 weights the codes are decoded times their row
    # scales (``PackedFP8LinearMethod``); with quantization="gguf" the blocks are dequantized
    # (:class:`kv8.layers.linear.GGUFLinearMethod`; below it, and with 0 at every row count, the int8 kernel)
    wide_rows: int = 0
    # quantization="gguf": ``(block type, rows)`` pairs, sorted by type, each type's own ``wide_rows`` (0: the int8
    # kernel at every row count), chosen per type by kv8.layers.tuning; a type not listed uses ``wide_rows``
    gguf_wide_rows: tuple[tuple[str, int], ...] = ()
    # quantization="gguf": what the blocks are dequantized to from the switch on (GGUF_EXPANSIONS): ``gguf_expand``
    # for ``wide_rows``, and ``"bf16"`` for the types of ``gguf_wide_rows`` listed in ``gguf_bf16`` (sorted; the others
    # there: "f32")
    gguf_expand: str = "f32"
    gguf_bf16: tuple[str, ...] = ()
    # packed_bf16 with quantization="fp8": calls of up to this many rows decode the codes in registers, longer ones
    # into a buffer once per call (the same bits; :data:`kv8.kernels.cpu.dense.FP8_REGISTER_ROWS`), chosen per
    # machine by kv8.layers.tuning
    fp8_register_rows: int = FP8_REGISTER_ROWS
    # quantization="gguf": ``(block type, path)`` pairs, sorted by type: the int8 kernel's path
    # (``DenseKernels.gguf_paths``) for one-row calls of layers of that type, chosen per machine by kv8.layers.tuning
    # (the same bits on every path); a type not listed, and calls of more rows, run the kernels' default
    # (``DenseKernels.gguf_path``)
    gguf_kernel_paths: tuple[tuple[str, str], ...] = ()
    # quantization="gguf": the int8 kernel's path for the LM head's one-row calls, chosen alike ("": the default)
    gguf_head_path: str = ""

    @property
    def label(self) -> str:
        """The name, with the float32 GEMM of long chunks where it is on (``packed_bf16+f32_from_512``; GGUF blocks
        expanded to bf16: ``packed_bf16+bf16_from_128``), FP8 codes decoded into a buffer from a row count other than
        the fixed rule's (``packed_bf16+fp8_buffer_from_17``), and each block type's switch where it has its own
        (``packed_bf16[Q4_K:int8,Q6_K:f32_from_32]``), and the int8 kernel's path per type where chosen
        (``packed_bf16{Q4_K:vnni256,lm_head:vnni256}``)."""
        label = f"{self.name}+{self.gguf_expand}_from_{self.wide_rows}" if self.wide_rows else self.name
        if self.fp8_register_rows != FP8_REGISTER_ROWS:
            label += f"+fp8_buffer_from_{self.fp8_register_rows + 1}"
        if self.gguf_wide_rows:
            label += "[" + ",".join(f"{qtype}:{self.expansion_of(qtype)}_from_{rows}" if rows else f"{qtype}:int8"
                                    for qtype, rows in self.gguf_wide_rows) + "]"
        paths = [*self.gguf_kernel_paths, *([("lm_head", self.gguf_head_path)] if self.gguf_head_path else [])]
        if paths:
            label += "{" + ",".join(f"{group}:{path}" for group, path in paths) + "}"
        return label

    def wide_rows_of(self, qtype: str) -> int:
        """The row count from which a layer's blocks of ``qtype`` are dequantized (0: never): its own, else
        ``wide_rows``."""
        return dict(self.gguf_wide_rows).get(qtype, self.wide_rows)

    def expansion_of(self, qtype: str) -> str:
        """What a layer's blocks of ``qtype`` are dequantized to from its switch on (:data:`GGUF_EXPANSIONS`)."""
        if qtype in dict(self.gguf_wide_rows):
            return "bf16" if qtype in self.gguf_bf16 else "f32"
        return self.gguf_expand

    @property
    def linear_fp32(self) -> bool:
        """The linear layers hold float32 weights and multiply in float32 (``torch_fp32``)."""
        return self.name == "torch_fp32"

    def __post_init__(self) -> None:
        if (self.name == "packed_bf16") != (self.kernels is not None):
            raise ValueError(f"dense backend {self.name!r} must come with kernels exactly when it is 'packed_bf16'")
        if self.fp8_scaled_mm and (self.name != "torch" or self.quantization != "fp8"):
            raise ValueError("fp8_scaled_mm needs the torch dense backend with quantization='fp8'")
        if self.wide_rows < 0 or (self.wide_rows and self.name != "packed_bf16"):
            raise ValueError(f"wide_rows={self.wide_rows}: >= 0, and non-zero only for packed_bf16 (the model's own "
                             "weights, FP8 weights or GGUF blocks)")
        if self.fp8_register_rows != FP8_REGISTER_ROWS and (
                self.fp8_register_rows < 0 or self.name != "packed_bf16" or self.quantization != "fp8"):
            raise ValueError(f"fp8_register_rows={self.fp8_register_rows}: >= 0, and other than "
                             f"{FP8_REGISTER_ROWS} only for packed_bf16 with quantization='fp8', not {self.name!r} "
                             f"with quantization={self.quantization!r}")
        if self.gguf_wide_rows:
            types = [qtype for qtype, _ in self.gguf_wide_rows]
            if self.name != "packed_bf16" or self.quantization != "gguf":
                raise ValueError(f"gguf_wide_rows={self.gguf_wide_rows}: only for packed_bf16 with quantization='gguf'"
                                 f", not {self.name!r} with quantization={self.quantization!r}")
            if types != sorted(set(types)) or any(rows < 0 for _, rows in self.gguf_wide_rows):
                raise ValueError(f"gguf_wide_rows={self.gguf_wide_rows}: one (block type, rows >= 0) pair per type, "
                                 "sorted by type")
        if self.gguf_expand not in GGUF_EXPANSIONS:
            raise ValueError(f"gguf_expand={self.gguf_expand!r}: one of {', '.join(GGUF_EXPANSIONS)}")
        if self.gguf_expand != "f32" and (self.quantization != "gguf" or not self.wide_rows):
            raise ValueError(f"gguf_expand={self.gguf_expand!r} needs quantization='gguf' and a switch (wide_rows > 0)")
        switched = [qtype for qtype, rows in self.gguf_wide_rows if rows]
        if list(self.gguf_bf16) != sorted(set(self.gguf_bf16)) or any(t not in switched for t in self.gguf_bf16):
            raise ValueError(f"gguf_bf16={self.gguf_bf16}: sorted block types, each with a switch of its own in "
                             f"gguf_wide_rows ({self.gguf_wide_rows})")


TORCH_BACKEND = DenseBackend("torch")


def _torch_backend(quantization: str | None) -> DenseBackend:
    return TORCH_BACKEND if quantization is None else DenseBackend("torch", None, quantization)


def select_dense_backend(name: str, dtype: torch.dtype, quantization: str | None = None,
                         platform: Platform = CPU) -> DenseBackend:
    """The backend for option ``name`` with the weight ``quantization`` on ``platform``, all validated by the
    engine's config (:class:`kv8.engine.config.EngineConfig`: ``name`` usable with ``dtype`` and the device,
    ``quantization`` None or ``"fp8"``). On CUDA: torch, with FP8 weights through ``torch._scaled_mm`` where the
    GPU has FP8 tensor cores (:attr:`kv8.platform.Platform.fp8_tensor_cores`). ``packed_bf16`` raises
    :class:`KernelUnavailable` if the kernels cannot be built or loaded; ``auto`` then says why once per process and
    uses torch; models in other dtypes than bf16 use torch."""
    global _auto_fallback_logged
    if platform.kind != "cpu":
        scaled_mm = quantization == "fp8" and platform.fp8_tensor_cores
        return DenseBackend("torch", None, quantization, fp8_scaled_mm=scaled_mm)
    if name == "torch_fp32":
        return DenseBackend("torch_fp32", None, quantization)
    if name == "torch" or dtype != torch.bfloat16:
        return _torch_backend(quantization)
    try:
        kernels = load_dense_kernels()
    except KernelUnavailable as exc:
        if name == "packed_bf16":
            raise
        if not _auto_fallback_logged:
            _auto_fallback_logged = True
            # the text, not the exception: a log record that keeps it keeps its frames (and the engine) alive
            logger.warning("dense layers: using torch because kv8's CPU kernels are unavailable: %s", str(exc))
        return _torch_backend(quantization)
    return DenseBackend("packed_bf16", kernels, quantization,
                        wide_rows=GGUF_DEQUANTIZE_ROWS if quantization == "gguf" else 0)
