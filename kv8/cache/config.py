"""The KV cache's options, declared and validated once: :class:`CacheConfig` (its sizes: :mod:`kv8.cache.budget`).

Each field is declared with :func:`kv8.options.option` (default, help, allowed values); the engine's arguments
take them from here (:func:`kv8.options.from_config`), so an option's default and help live in one place.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import cached_property

import torch

from kv8.cache.codec import SCALE_MODES
from kv8.cache.plan import KVPlanFile, KVSpec, read_plan_file
from kv8.options import option
from kv8.quant.formats import (
    KV_PAIR_ALIASES,
    KVCacheDtype,
    check_kv_cache_dtype,
    resolve_kv_cache_dtype,
    resolve_kv_cache_dtypes,
    split_kv_cache_dtype,
)
from kv8.quant.rotation import ROTATION_HELP, canonical_rotation
from kv8.quant.scale_files import file_has_key_offsets, file_has_key_scaling
from kv8.validators import check_bool, check_choice, check_int, check_number, is_int

__all__ = ["SKIP_LAYER_KINDS", "CacheConfig"]

def _kv_cache_dtype_flag(text: str) -> str:
    """``--kv-cache-dtype``'s converter: the name when it is accepted, else argparse's error with what is allowed."""
    try:
        return check_kv_cache_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_cache_rotation_flag(text: str) -> str:
    """``--kv-cache-rotation``'s converter: the canonical name when it is accepted, else argparse's error with what
    is allowed."""
    try:
        return canonical_rotation(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# kv_cache_dtype_skip_layers entries besides layer indices: every layer of that kind stays in the compute dtype
SKIP_LAYER_KINDS = ("sliding_window", "full_attention")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache settings: the options of the same names, once converted (``kv_cache_memory`` in bytes,
    ``kv_cache_dtype_skip_layers`` a tuple), and ``kv_dtype``, the format ``kv_cache_dtype`` names (``auto``: the
    compute dtype's; for a K/V pair such as ``"int8/int4_g32"`` or ``"k8v4"``, the keys' format, and :attr:`v_dtype`
    the values').

    ``kv_cache_memory`` (bytes) or ``num_kv_blocks`` fixes the budget; with neither, the engine derives one from
    the device: on a GPU, ``gpu_memory_utilization`` of its total memory less what is in use and what the weights
    and activations take (:func:`kv8.cache.budget.gpu_kv_cache_memory`); on the CPU, from the machine's free memory
    (:func:`kv8.cache.budget.default_kv_cache_memory`).

    ``kv_cache_scale_mode``: ``static`` -- per-layer scales (file, checkpoint, or 1.0); ``dynamic`` -- a scale per
    token and KV head, computed when the token is stored (``amax / format max``) and kept beside it. It applies to
    FP8 caches; ``int8_per_token_head`` always has dynamic scales (:attr:`dynamic_scales`), whatever it says.
    ``kv_cache_rotation``: ``hadamard`` -- K and V are multiplied by an orthonormal per-head Hadamard matrix before
    they are stored; the same matrix is folded into q and undone on the attention output, so attention is unchanged
    in exact arithmetic while outliers are spread across channels before rounding. Needs a power-of-two head_dim
    (checked by :class:`kv8.engine.config.EngineConfig`, which knows the model).

    ``kv_cache_dtype_skip_layers``: layer indices and :data:`SKIP_LAYER_KINDS` whose layers stay in the compute
    dtype while the rest are quantized (FP8 or int8). ``kv_cache_plan``: a JSON file giving layers their own format
    and rotation (:mod:`kv8.cache.plan`; read once, here, as :attr:`plan`; the layer indices are checked against the
    model by :class:`kv8.engine.config.EngineConfig`); ``kv_cache_scale_mode`` and ``quantization_param_path`` then
    apply to the plan's FP8 layers. ``disable_hybrid_kv_cache_manager``: sliding-window layers
    keep every block instead of only those inside their window (:attr:`hybrid` is its negation; attention is
    windowed either way).

    Key centering (:mod:`kv8.quant.key_offsets`) is on when ``quantization_param_path`` is a kv8 file with key
    offsets (:attr:`key_centering`); such a file may be given with any cache format (its static scales are used by
    FP8 layers in static mode only).

    Invariants: ``block_size`` is a power of two; at most one of ``kv_cache_memory`` (bytes) and
    ``num_kv_blocks`` is set, and it is an int >= 1; ``gpu_memory_utilization`` is a number in (0, 1]; the scale
    mode in :data:`SCALE_MODES`, the rotation one of :data:`kv8.quant.rotation.ROTATIONS` or a K/V pair of them,
    spelled canonically (``"hadamard/hadamard"`` becomes ``"hadamard"``); ``quantization_param_path`` needs an FP8
    ``kv_dtype`` in static mode (unless the file has key offsets), dynamic scales and skipped layers a quantized
    one (FP8 or int8; the group-scaled fp4_e2m1 and int4_per_group32 take skipped layers, never dynamic scales or a
    file without key offsets) -- with a
    plan, an FP8 format named by ``kv_cache_dtype`` or the plan; a plan and skipped layers exclude each other.
    """

    kv_dtype: KVCacheDtype   # kv_cache_dtype resolved against the compute dtype
    kv_cache_dtype: str = option("auto", "KV cache storage: auto = the compute dtype; fp8 = fp8_e4m3 (1 byte per "
                                 "value); int8 = int8_per_token_head (1 byte per value, a scale per token and "
                                 "head); int4_per_group32 (4.5 bits per value: int4 codes, a float16 scale per 32 "
                                 "values; head_dim a multiple of 32); nvfp4 = fp4_e2m1 (4.5 bits per value: E2M1 "
                                 "codes, an E4M3 scale per 16 values); KFORMAT/VFORMAT stores keys and values "
                                 "apart, e.g. int8/int4_g32 (" + ", ".join(f"{a} = {k}/{v}" for a, (k, v) in
                                                               KV_PAIR_ALIASES.items()) + ")",
                                 type=_kv_cache_dtype_flag, metavar="FORMAT")
    block_size: int = option(16, "tokens per KV block (a power of two)", type=int)
    kv_cache_memory: int | None = option(
        None, "KV cache budget: bytes or a size such as 2GiB (default: on CUDA what gpu_memory_utilization leaves; "
        "on the CPU 25% of free memory, at most 4GiB)", type=int, metavar="SIZE")
    gpu_memory_utilization: float = option(
        0.9, "fraction of the GPU's total memory the engine may use, weights and activations included; the KV cache "
        "gets the rest (CUDA only; kv_cache_memory or num_kv_blocks overrides it)", type=float)
    num_kv_blocks: int | None = option(None, "KV cache budget in blocks instead of bytes", type=int)
    enable_prefix_caching: bool = option(True, "reuse cached KV blocks of shared prompt prefixes", type=bool)
    quantization_param_path: str | None = option(
        None, "KV scales file: vLLM's kv_cache_scales.json or kv8's JSON from kv8 calibrate (FP8 caches; a file "
        "from kv8 calibrate --key-centering turns key centering on for every cache format)", metavar="JSON")
    kv_cache_scale_mode: str = option(
        "static", "FP8 scales: static per layer (file, checkpoint or 1.0) or dynamic per token and head "
        "(no calibration; +4 bytes per token, head and K/V); int8 is always dynamic", choices=SCALE_MODES)
    kv_cache_rotation: str = option(
        "none", "rotate K/V by a per-head Hadamard matrix before storing (more accurate FP8 on most models; see "
        f"kv8 eval): {ROTATION_HELP}", type=_kv_cache_rotation_flag, metavar="ROTATION")
    kv_cache_dtype_skip_layers: tuple[int | str, ...] = option(
        (), "layers kept in the compute dtype in an FP8 or int8 cache: comma-separated layer indices and/or "
        "'sliding_window' (every sliding-window layer) or 'full_attention'", metavar="LAYERS")
    kv_cache_plan: str | None = option(
        None, 'per-layer KV formats and rotations: a JSON file {"kv8_kv_plan": 1, "layers": {"0": {"kv_cache_dtype": '
        '"bfloat16"}, "5": {"kv_cache_dtype": "int4", "kv_cache_rotation": "hadamard"}}}; layers it does not name '
        'use kv_cache_dtype and kv_cache_rotation', metavar="JSON")
    disable_hybrid_kv_cache_manager: bool = option(
        False, "keep every block of sliding-window layers instead of freeing those that leave the window",
        type=bool)

    @cached_property
    def v_dtype(self) -> KVCacheDtype:
        """The values' format: :attr:`kv_dtype` unless ``kv_cache_dtype`` is a K/V pair (whose sides name formats
        that do not depend on the compute dtype: a pair has no ``auto``)."""
        pair = split_kv_cache_dtype(self.kv_cache_dtype)
        return self.kv_dtype if pair is None else resolve_kv_cache_dtypes(self.kv_cache_dtype, torch.float32)[1]

    @property
    def is_pair(self) -> bool:
        """Keys and values are stored in different formats."""
        return self.v_dtype != self.kv_dtype

    @property
    def dynamic_scales(self) -> bool:
        """Each stored token keeps a scale per KV head: ``kv_cache_scale_mode="dynamic"``, an int8 cache, or a K/V
        pair with an FP8 or int side."""
        return self.kv_cache_scale_mode == "dynamic" or self.kv_dtype.per_token_scales or (
            self.is_pair and self.default_spec.dynamic)

    @property
    def default_spec(self) -> KVSpec:
        """How the layers that no plan or skip list names are stored (``kv_cache_dtype``, rotation, scale mode)."""
        return KVSpec.of(self.kv_dtype, self.kv_cache_rotation, self.kv_cache_scale_mode, self.v_dtype)

    @cached_property
    def plan(self) -> KVPlanFile | None:
        """The ``kv_cache_plan`` file, read (once: at construction) and its names checked; None without one."""
        return None if self.kv_cache_plan is None else read_plan_file(self.kv_cache_plan)

    @cached_property
    def key_centering(self) -> bool:
        """Keys are centered by the offsets of the ``quantization_param_path`` file (a kv8 file with ``k_offset``,
        written by ``kv8 calibrate --key-centering``); the file is read the first time this is asked. A file that
        cannot be read or parsed has no offsets here: the option's other checks then name what it was given for,
        and the engine's loaders say why the file is unusable."""
        if self.quantization_param_path is None:
            return False
        try:
            return file_has_key_offsets(self.quantization_param_path)
        except ValueError:
            return False

    @cached_property
    def key_scaling(self) -> bool:
        """Keys are also scaled by the factors of the ``quantization_param_path`` file (``k_channel_scale``, beside
        its key offsets: ``kv8 calibrate --key-centering --key-scaling``); read as :attr:`key_centering` is."""
        if not self.key_centering or self.quantization_param_path is None:
            return False
        try:
            return file_has_key_scaling(self.quantization_param_path)
        except ValueError:
            return False

    @property
    def hybrid(self) -> bool:
        """Sliding-window layers free the blocks that left their window (vLLM's hybrid KV cache manager)."""
        return not self.disable_hybrid_kv_cache_manager

    def __post_init__(self) -> None:
        check_choice("kv_cache_scale_mode", self.kv_cache_scale_mode, SCALE_MODES)
        object.__setattr__(self, "kv_cache_rotation", canonical_rotation(self.kv_cache_rotation))
        if not is_int(self.block_size) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size!r} must be a power of two >= 1 (e.g. 16)")
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ValueError("give either kv_cache_memory or num_kv_blocks, not both")
        check_int("kv_cache_memory", self.kv_cache_memory, 1, optional=True)
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, exclusive_minimum=True)
        check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("disable_hybrid_kv_cache_manager", self.disable_hybrid_kv_cache_manager)
        for entry in self.kv_cache_dtype_skip_layers:
            if entry not in SKIP_LAYER_KINDS and not (is_int(entry) and int(entry) >= 0):
                raise ValueError(f"kv_cache_dtype_skip_layers entry {entry!r} must be a layer index >= 0 or one of: "
                                 f"{', '.join(SKIP_LAYER_KINDS)}")
        pair = split_kv_cache_dtype(self.kv_cache_dtype)
        if pair is not None and resolve_kv_cache_dtype(pair[0], torch.float32) != self.kv_dtype:
            raise ValueError(f"CacheConfig: kv_dtype={self.kv_dtype.name!r} is not the keys' format of "
                             f"kv_cache_dtype={self.kv_cache_dtype!r} (resolve_kv_cache_dtypes gives both)")
        if self.kv_cache_plan is not None:
            self._check_plan()
            return
        if self.is_pair:
            self._check_pair()
            return
        if self.kv_dtype.group_scales:
            self._check_group_scaled()
            return
        if self.kv_dtype.is_quantized:
            if self.dynamic_scales and self.quantization_param_path is not None and not self.key_centering:
                what = (f"kv_cache_dtype={self.kv_cache_dtype!r}" if self.kv_dtype.per_token_scales
                        else "kv_cache_scale_mode='dynamic'")
                raise ValueError(f"{what} computes scales per token; it cannot be combined with "
                                 f"quantization_param_path={self.quantization_param_path!r}, a file without key "
                                 "offsets (drop one of them, or use a file from kv8 calibrate --key-centering)")
            return
        auto = f" (the {self.kv_dtype.name} compute dtype)" if self.kv_cache_dtype == "auto" else ""
        not_fp8 = (f"kv_cache_dtype={self.kv_cache_dtype!r}{auto} is not an FP8 format; set kv_cache_dtype='fp8' "
                   "(or fp8_e4m3 / fp8_e4m3fnuz / fp8_e5m2)")
        if self.dynamic_scales:
            raise ValueError(f"kv_cache_scale_mode='dynamic' needs an FP8 cache, but {not_fp8} (or "
                             "int8_per_token_head, which is always dynamic)")
        if self.quantization_param_path is not None and not self.key_centering:
            raise ValueError(f"quantization_param_path={self.quantization_param_path!r} gives FP8 KV scales (and no "
                             f"key offsets: kv8 calibrate --key-centering writes them), but {not_fp8} or drop "
                             "quantization_param_path")
        if self.kv_cache_dtype_skip_layers:
            raise ValueError(f"kv_cache_dtype_skip_layers keeps layers out of a quantized cache, but {not_fp8} (or "
                             "int8_per_token_head)")

    def _check_pair(self) -> None:
        """A K/V pair keeps per-token scales on its FP8 and int sides and group scales on a group-scaled side: it
        takes no static scales (a file with key offsets only centers the keys); ``kv_cache_scale_mode='dynamic'``
        only says what its FP8 side does anyway; skipped layers need a quantized side."""
        sides = (self.kv_dtype, self.v_dtype)
        what = f"kv_cache_dtype={self.kv_cache_dtype!r} ({self.kv_dtype.name} keys, {self.v_dtype.name} values)"
        if self.kv_cache_scale_mode == "dynamic" and not any(d.is_fp8 for d in sides):
            raise ValueError(f"kv_cache_scale_mode='dynamic' applies to FP8 formats, but {what} has no FP8 side "
                             "(leave it 'static')")
        if self.quantization_param_path is not None and not self.key_centering:
            raise ValueError(f"{what} keeps its scales per token and head or per group; quantization_param_path="
                             f"{self.quantization_param_path!r} has no key offsets and its static scales would be "
                             "ignored (drop it, or use a file from kv8 calibrate --key-centering)")
        if self.kv_cache_dtype_skip_layers and not any(d.is_quantized for d in sides):
            raise ValueError(f"kv_cache_dtype_skip_layers keeps layers out of a quantized cache, but {what} "
                             "quantizes neither side")

    def _check_group_scaled(self) -> None:
        """A format with its scales in each row (``fp4_e2m1``, ``int4_per_group32``) takes no other scales: neither
        dynamic per-token scales nor a scales file (one with key offsets only centers the keys)."""
        group = self.kv_dtype.group
        assert group is not None
        what = (f"kv_cache_dtype={self.kv_cache_dtype!r} stores a scale per group of {group.group_size} values "
                f"({group.scale_name}) beside its codes")
        if self.kv_cache_scale_mode == "dynamic":
            raise ValueError(f"{what}; kv_cache_scale_mode='dynamic' does not apply to it (leave it 'static')")
        if self.quantization_param_path is not None and not self.key_centering:
            raise ValueError(f"{what}; quantization_param_path={self.quantization_param_path!r} has no key offsets "
                             "and its scales would be ignored (drop it, or use a file from kv8 calibrate "
                             "--key-centering)")

    def _check_plan(self) -> None:
        """Read the plan file; the scale options against the FP8 formats that ``kv_cache_dtype`` and it name."""
        if not isinstance(self.kv_cache_plan, str) or not self.kv_cache_plan:
            raise ValueError(f"kv_cache_plan={self.kv_cache_plan!r} must be the path of a JSON plan file")
        plan = self.plan
        assert plan is not None
        if self.kv_cache_dtype_skip_layers:
            raise ValueError(f"kv_cache_plan={plan.path!r} and kv_cache_dtype_skip_layers both set layers' formats; "
                             'give one of them (a plan keeps layer N in the compute dtype with "N": '
                             '{"kv_cache_dtype": "auto"})')
        if self.is_pair:
            self._check_pair()
        named = [self.kv_dtype, self.v_dtype,
                 *(d for n in plan.kv_cache_dtypes() for d in resolve_kv_cache_dtypes(n, torch.float32))]
        fp8 = any(d.is_fp8 for d in named)
        dynamic = self.kv_cache_scale_mode == "dynamic"
        neither = (f"neither kv_cache_dtype={self.kv_cache_dtype!r} nor kv_cache_plan={plan.path!r} names an FP8 "
                   "format")
        if dynamic and not fp8:
            raise ValueError(f"kv_cache_scale_mode='dynamic' applies to a plan's FP8 layers, but {neither} (the int "
                             "formats always keep scales per token)")
        if self.quantization_param_path is not None and (dynamic or not fp8) and not self.key_centering:
            why = "kv_cache_scale_mode='dynamic' computes them per token" if dynamic else neither
            raise ValueError(f"quantization_param_path={self.quantization_param_path!r} gives static scales for a "
                             f"plan's FP8 layers, but {why}; drop one of them")
