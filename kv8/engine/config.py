"""The engine's own options and the validated whole: :class:`SchedulerConfig`, :class:`EngineConfig`, the compute
dtype names, and the allowed values of the attention and dense backends and of weight quantization.

:class:`EngineConfig` composes the configs of each part (the model's architecture, :class:`kv8.cache.config.
CacheConfig`, :class:`SchedulerConfig`, :class:`kv8.distributed.config.ParallelConfig`) and checks what needs
several of them (a rotation against the model's head_dim, the context against the model's). An
:class:`EngineConfig` that exists is a valid configuration: code below the engine does not check it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kv8.attention.backend import BACKENDS, CPU_ONLY_BACKENDS
from kv8.cache.budget import NO_RESERVE, DeviceReserve, KVBudget
from kv8.cache.config import CacheConfig
from kv8.cache.plan import KVPlan, KVSpec
from kv8.distributed.config import ParallelConfig
from kv8.engine.memory import estimate_device_reserve
from kv8.envs import triton_interpret
from kv8.models.config import ModelArchConfig
from kv8.options import option
from kv8.platform import CPU, DEVICES, Platform
from kv8.quant.formats import resolve_kv_cache_dtype, resolve_kv_cache_dtypes
from kv8.quant.rotation import is_rotated
from kv8.validators import check_bool, check_choice, check_int

__all__ = ["ATTENTION_BACKENDS", "DENSE_BACKENDS", "DTYPE_CHOICES", "LOAD_FORMATS", "QUANTIZATION_CHOICES",
           "QUANTIZATION_METHODS", "EngineConfig", "SchedulerConfig", "resolve_dtype"]

# auto, then the backends registered in kv8.attention.backend
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", *BACKENDS)
# torch ops, or kv8's packed linear layers (AVX-512 BF16 / AMX, or AVX2) with fused norm/SiLU/RoPE
# (kv8.kernels.cpu.dense)
DENSE_BACKENDS = ("auto", "torch", "torch_fp32", "packed_bf16")
# weight quantization at load (vLLM's --quantization): fp8 = E4M3 weights with one float32 scale per output row;
# gguf = a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K / Q6_K blocks kept as they are (kv8.quant.gguf_blocks)
QUANTIZATION_METHODS = ("fp8", "gguf")
# what EngineArgs.quantization takes: a method, or none = the checkpoint's weights in the compute dtype (a GGUF file's
# blocks dequantized at load); unset, a quantized GGUF file keeps its blocks where kv8's kernels read them
# (kv8.engine.args.default_quantization)
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, "none")

_DTYPES: dict[str, torch.dtype] = {
    "auto": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
DTYPE_CHOICES: tuple[str, ...] = tuple(_DTYPES)  # matched case-insensitively by resolve_dtype

# vLLM's --load-format: auto = the checkpoint's weights; dummy = random weights of its shapes (speed measurements)
LOAD_FORMATS = ("auto", "dummy")
# what each dense backend runs on
_DENSE_DEVICES = {"auto": DEVICES, "torch": DEVICES, "torch_fp32": ("cpu",), "packed_bf16": ("cpu",)}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Compute dtype from a vLLM-style name; ``auto`` is bfloat16 (the CPU has native bf16)."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16, torch.float32):
            return dtype
        raise ValueError(f"dtype={dtype} is not supported; choose one of: bfloat16, float16, float32")
    if not isinstance(dtype, str) or dtype.lower() not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of: {', '.join(_DTYPES)}")
    return _DTYPES[dtype.lower()]


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits.

    Invariant: ``max_num_batched_tokens >= 1``; a prompt longer than the per-step budget is prefilled in
    chunks (chunked prefill), so the budget never limits prompt length -- ``max_model_len`` does.
    """

    max_model_len: int   # resolved from the option (None: the model's context, at most DEFAULT_MAX_MODEL_LEN)
    max_num_seqs: int = option(64, "max sequences per step", type=int)
    max_num_batched_tokens: int = option(2048, "max tokens per step (longer prompts are prefilled in chunks)",
                                         type=int)

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_model_len", self.max_model_len, 2)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, validated. Built by :meth:`kv8.engine.args.EngineArgs.create_engine_config`.

    Invariants beyond those of its parts: ``attention_backend`` is in :data:`ATTENTION_BACKENDS`; ``dense_backend`` is
    in :data:`DENSE_BACKENDS` and usable with ``dtype``; ``quantization`` is None or in
    :data:`QUANTIZATION_METHODS`; ``max_model_len`` fits the model's context; ``kv_cache_dtype_skip_layers`` and
    ``kv_cache_plan`` name layers the model has (:meth:`kv_plan`: each layer's storage spec); a Hadamard rotation
    (of any layer) has a power-of-two ``head_dim``, a group-scaled format (of any layer) whole groups in it
    (``int4_per_group32``: a multiple of 32; ``fp4_e2m1``: even); the triton backend gets only layers whose format
    its kernels read (:func:`kv8.kernels.triton.formats.kernel_format`: every kv8 cache format);
    ``quantization_param_path`` has an FP8 static layer to apply to; the model splits over the tensor-parallel ranks;
    ``seed`` is an int.
    """

    model: str
    model_kind: str  # "hf" or "gguf"
    arch: ModelArchConfig
    dtype: torch.dtype
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int = option(0, "engine seed for requests without their own", type=int)
    attention_backend: str = option(
        "auto", "attention: auto = triton on CUDA; on the CPU cpu_fused (kv8's fused CPU kernels) if they build, "
        "else reference (plain torch)",
        choices=ATTENTION_BACKENDS)
    dense_backend: str = option(
        "auto", "linear layers, norms, activation, RoPE: torch; torch_fp32 (torch, the linear weights held in "
        "float32: fast where the CPU has no native bf16); packed_bf16 (kv8's AVX-512 BF16 / AMX or AVX2 kernels); "
        "auto = the fastest on this machine, timed on the model's shapes at its first run and kept (kv8 tune)",
        choices=DENSE_BACKENDS)
    # how the decoder's linear layers hold their weights: None (as loaded, in the compute dtype) or a
    # QUANTIZATION_METHODS name -- EngineArgs.quantization resolved (unset: default_quantization's choice, "none": None)
    quantization: str | None = None
    # quantization was not given and default_quantization chose it (a GGUF file's blocks kept): the startup line and
    # kv8 info say so
    quantization_auto: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    platform: Platform = CPU   # the machine, resolved once from the device option (Platform.resolve)
    load_format: str = option("auto", "how weights are loaded: auto = from the model's checkpoint; dummy = random "
                              "weights of the model's shapes (no checkpoint read: for speed measurements)",
                              choices=LOAD_FORMATS)
    enforce_eager: bool = option(False, "never capture graphs: every step runs the model's Python and launches its "
                                 "kernels (otherwise decode steps are replayed from graphs captured at start-up: on "
                                 "CUDA of up to max_num_seqs sequences, on the CPU of up to 8)", type=bool)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("dense_backend", self.dense_backend, DENSE_BACKENDS)
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_bool("enforce_eager", self.enforce_eager)
        self._check_device_support()
        if self.dense_backend == "packed_bf16" and self.dtype != torch.bfloat16:
            raise ValueError(f"dense_backend='packed_bf16' needs dtype bfloat16, got {self.dtype}; use "
                             "dense_backend='auto' or 'torch'")
        check_choice("quantization", self.quantization, QUANTIZATION_METHODS, optional=True,
                     hint="(or leave it unset for the checkpoint's weights)")
        if self.quantization == "gguf":
            self._check_gguf_quantization()
        check_int("seed", self.seed)
        arch, max_len = self.arch, self.scheduler.max_model_len
        self.parallel.check_model(arch)
        cc = self.cache
        if cc.kv_cache_plan is None and not cc.kv_cache_dtype_skip_layers:
            # one spec for every layer: nothing per layer to check, and no list as long as a configuration's layer
            # count, which the loader checks against the checkpoint later (a config may claim 10^9 layers)
            specs: tuple[KVSpec, ...] = (cc.default_spec,)
            rotated_layers: list[int] | None = None
        else:
            plan = self.kv_plan()   # validates kv_cache_dtype_skip_layers and kv_cache_plan against the model
            specs = plan.used()
            rotated = [i for i, s in enumerate(plan.specs) if is_rotated(s.rotation) and i in plan.layer_spec]
            rotated_layers = list(plan.layers_of(rotated[-1])) if rotated and rotated != [0] else None
        spec_rotated = [s for s in specs if is_rotated(s.rotation)]
        if spec_rotated and arch.head_dim & (arch.head_dim - 1):
            where = "" if rotated_layers is None else f" (kv_cache_plan: layers {rotated_layers})"
            raise ValueError(f"kv_cache_rotation={spec_rotated[-1].rotation!r}{where} needs a power-of-two head_dim; "
                             f"this model has head_dim={arch.head_dim}")
        for spec in specs:   # a group-scaled format needs whole groups (int4_per_group32: head_dim % 32 == 0)
            for side in (spec.kv_dtype, spec.values_dtype):
                if side.group is not None:
                    side.group.check_head_dim(arch.head_dim, side.name)
        if cc.quantization_param_path is not None and not any(s.static_fp8 for s in specs) and not cc.key_centering:
            raise ValueError(f"quantization_param_path={self.cache.quantization_param_path!r} gives static FP8 "
                             f"scales, but no layer of kv_cache_plan={self.cache.kv_cache_plan!r} is stored in "
                             "FP8; drop quantization_param_path")
        if cc.quantization_param_path is not None and cc.key_centering and not arch.shift_invariant_scores:
            raise ValueError(f"quantization_param_path={cc.quantization_param_path!r} has key offsets (key "
                             f"centering), which shift every score of a query by one constant; that is exact only "
                             f"when softmax sees the scores unchanged, but this {arch.model_type} model "
                             f"{arch.score_transform}; use a scales file without key offsets (kv8 calibrate without "
                             "--key-centering)")
        if cc.quantization_param_path is not None and cc.key_scaling and any(s.static_fp8 for s in specs):
            raise ValueError(f"quantization_param_path={cc.quantization_param_path!r} has key scaling's factors "
                             "(k_channel_scale), but its static FP8 scales describe unscaled keys, so a static-scale "
                             "FP8 cache cannot use it; use kv_cache_scale_mode='dynamic', a 4-bit or int8 "
                             "kv_cache_dtype, or a file without --key-scaling")
        if max_len > arch.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's context "
                             f"(max_position_embeddings={arch.max_position_embeddings})")

    def _check_gguf_quantization(self) -> None:
        """``quantization="gguf"`` keeps the blocks of a GGUF file, read from it (each tensor-parallel rank its part:
        a shape that does not split on block boundaries fails at load, naming the layer)."""
        if self.model_kind != "gguf":
            raise ValueError(f"quantization='gguf' keeps the blocks of a GGUF file, but model={self.model!r} is a "
                             f"{self.model_kind} checkpoint; use quantization='fp8' or leave it unset")
        if self.load_format != "auto":
            raise ValueError(f"quantization='gguf' reads the file's blocks; load_format={self.load_format!r} reads "
                             "none: use load_format='auto'")

    def _check_device_support(self) -> None:
        """Every option runs on the platform (which exists, so its device is usable)."""
        kind = self.platform.kind
        if kind not in _DENSE_DEVICES[self.dense_backend]:
            raise ValueError(f"dense_backend={self.dense_backend!r} runs on the CPU only, not on "
                             f"device={kind!r}; use dense_backend='auto' or 'torch'")
        if kind != "cpu" and self.attention_backend in CPU_ONLY_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} runs on the CPU only, not on "
                             f"device={kind!r}; use attention_backend='auto' (triton on CUDA) or 'triton'")
        if self.attention_backend == "triton":
            try:
                import triton  # noqa: F401  (the backend's only extra need)
            except ImportError:
                raise ValueError("attention_backend='triton' needs the triton package (pip install triton; CUDA "
                                 "builds of torch bring it)") from None
            if kind == "cpu" and not triton_interpret():
                raise ValueError("attention_backend='triton' runs on device='cuda'; on the CPU only in Triton's "
                                 "interpreter (TRITON_INTERPRET=1, slow: for tests); use attention_backend='auto' "
                                 "or 'cpu_fused' on the CPU")
        triton = self.attention_backend == "triton" or (self.attention_backend == "auto" and kind != "cpu")
        plan = self.cache.plan
        named = [(None, self.cache.kv_cache_dtype)] + ([(e.layer, e.kv_cache_dtype) for e in plan.entries
                                                        if e.kv_cache_dtype is not None] if plan is not None else [])
        if triton:
            # the formats the Triton kernels read: those kernel_format derives (every kv8 cache format, fp4_e2m1
            # included; a format it cannot derive is refused here, before any layer is built); imported here only,
            # the CPU path never imports the kernel package
            from kv8.kernels.triton.formats import check_compiled_packed_head_dim, kernel_format
            for layer, name in named:
                try:
                    k, v = (None if side.codes is None else kernel_format(side.codes)
                            for side in resolve_kv_cache_dtypes(name, self.dtype))
                    if not triton_interpret():   # compiled kernels: 4-bit codes up to head_dim 128
                        check_compiled_packed_head_dim((k, v), self.arch.head_dim)
                except ValueError as exc:
                    where = (f"kv_cache_dtype={name!r}" if layer is None else
                             f"kv_cache_plan={plan.path!r} stores layer {layer} as {name}")  # type: ignore[union-attr]
                    raise ValueError(f"{where}: the triton attention backend (the GPU path) cannot read this format "
                                     f"({exc}); choose another kv_cache_dtype for it, or run on the CPU") from None

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: where the platform has them, with the triton backend, one rank, unless
        ``enforce_eager``."""
        return (self.platform.cuda_graphs and not self.enforce_eager and self.parallel.tensor_parallel_size == 1
                and self.attention_backend in ("auto", "triton"))

    @property
    def uses_cpu_graphs(self) -> bool:
        """Decode steps of small batches replay CPU graphs (:mod:`kv8.kernels.cpu.graph`): on the CPU, with the fused
        CPU attention, one rank, unless ``enforce_eager``."""
        return (self.platform.kind == "cpu" and not self.enforce_eager and self.parallel.tensor_parallel_size == 1
                and self.attention_backend in ("auto", "cpu_fused"))

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in the cache of each tensor-parallel rank (the model's with one rank)."""
        return self.parallel.kv_heads_per_rank(self.arch)

    def kv_budget(self) -> KVBudget:
        """This engine's KV-cache sizes on one tensor-parallel rank (its layout, bytes per block, blocks)."""
        return KVBudget.build(self.cache, self.arch.layer_windows, plan=self.kv_plan(),
                              head_dim=self.arch.head_dim, kv_heads=self.kv_heads_per_rank,
                              max_model_len=self.scheduler.max_model_len,
                              max_num_batched_tokens=self.scheduler.max_num_batched_tokens, platform=self.platform,
                              reserve=self.device_reserve())

    def device_reserve(self) -> DeviceReserve:
        """What one rank's weights and largest step take on a GPU (estimated: :mod:`kv8.engine.memory`); nothing
        on the CPU, whose default budget does not count them."""
        if self.platform.kind == "cpu":
            return NO_RESERVE
        return estimate_device_reserve(
            self.arch, self.dtype, fp8_codes=self.quantization == "fp8" and self.platform.fp8_tensor_cores,
            tp_size=self.parallel.tensor_parallel_size, kv_heads=self.kv_heads_per_rank,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens, max_num_seqs=self.scheduler.max_num_seqs)

    def kv_plan(self) -> KVPlan:
        """Each layer's storage spec (:class:`kv8.cache.plan.KVPlan`; spec 0 is ``kv_cache_dtype``'s): the
        ``kv_cache_plan`` file's layers, or ``kv_cache_dtype_skip_layers``' in the compute dtype without a rotation,
        the others in ``cache.default_spec``. ``ValueError`` for a layer the model does not have."""
        arch, cc = self.arch, self.cache
        if cc.plan is not None:
            overrides = {}
            for e in cc.plan.entries:
                if e.layer >= arch.num_layers:
                    raise ValueError(f"kv_cache_plan={cc.plan.path!r} has layer {e.layer}, but the model has "
                                     f"{arch.num_layers} layers (0..{arch.num_layers - 1})")
                k_dtype, v_dtype = ((cc.kv_dtype, cc.v_dtype) if e.kv_cache_dtype is None
                                    else resolve_kv_cache_dtypes(e.kv_cache_dtype, self.dtype))
                overrides[e.layer] = KVSpec.of(k_dtype, e.kv_cache_rotation or cc.kv_cache_rotation,
                                               cc.kv_cache_scale_mode, v_dtype)
            return KVPlan.build(cc.default_spec, arch.num_layers, overrides)
        compute = KVSpec(resolve_kv_cache_dtype("auto", self.dtype))
        return KVPlan.build(cc.default_spec, arch.num_layers, dict.fromkeys(self._skipped_layers(), compute))

    def _skipped_layers(self) -> list[int]:
        """The layers ``kv_cache_dtype_skip_layers`` keeps in the compute dtype, ascending."""
        arch = self.arch
        skipped = [False] * arch.num_layers
        for entry in self.cache.kv_cache_dtype_skip_layers:
            if isinstance(entry, int):
                if entry >= arch.num_layers:
                    raise ValueError(f"kv_cache_dtype_skip_layers has layer {entry}, but the model has "
                                     f"{arch.num_layers} layers (0..{arch.num_layers - 1})")
                skipped[entry] = True
                continue
            kind = "sliding_attention" if entry == "sliding_window" else "full_attention"
            if not arch.has_layer_type(kind):
                raise ValueError(f"kv_cache_dtype_skip_layers has {entry!r}, but this model has no "
                                 f"{kind.replace('_', ' ')} layers")
            for i in range(arch.num_layers):
                skipped[i] = skipped[i] or arch.layer_type(i) == kind
        return [i for i in range(arch.num_layers) if skipped[i]]
