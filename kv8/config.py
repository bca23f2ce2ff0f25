"""Frozen, validated configuration objects, and the tuples that declare each option's allowed values.

Every user-facing option is checked once, here, when the engine is built: a bad value raises
``ValueError`` naming the field, the value and what is allowed. Later code trusts these objects: an
:class:`EngineConfig` that exists is a valid configuration, so code below the engine need not re-check it.
The CLI's ``choices`` come from the same tuples (:data:`DTYPE_CHOICES`, :data:`ATTENTION_BACKENDS`,
:data:`DENSE_BACKENDS`, :data:`SCALE_MODES`, :data:`ROTATIONS`; KV cache dtypes from
:data:`kv8.quant.formats.KV_CACHE_DTYPE_CHOICES`), see :class:`kv8.engine.args.EngineArgs`.

* :class:`ModelArchConfig` -- the architecture, normalised from a Hugging Face ``config.json`` dict
  (or the equivalent dict built from GGUF metadata).
* :class:`CacheConfig` -- KV cache dtype, block size, memory budget, prefix caching.
* :class:`SchedulerConfig` -- per-step token budget, concurrent sequences, context length.
* :class:`ParallelConfig` -- tensor-parallel size and threads per rank.
* :class:`EngineConfig` -- all of the above plus the model source and the compute dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kv8.cache.codec import ROTATIONS, SCALE_MODES, KVCodec
from kv8.quant.formats import KVCacheDtype

# auto, then the names registered in kv8.attention.backend.BACKENDS (tests check that the two agree)
ATTENTION_BACKENDS = ("auto", "cpu_fused", "reference")
# kv8.layers.dense_backend: torch ops, or kv8's packed AVX-512 BF16 linear layers with fused norm/SiLU/RoPE
DENSE_BACKENDS = ("auto", "torch", "packed_bf16")
# weight quantization at load (vLLM's --quantization): fp8 = E4M3 weights with one float32 scale per output row
QUANTIZATION_METHODS = ("fp8",)

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


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Compute dtype from a vLLM-style name; ``auto`` is bfloat16 (the CPU has native bf16)."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16, torch.float32):
            return dtype
        raise ValueError(f"dtype={dtype} is not supported; choose one of: bfloat16, float16, float32")
    if not isinstance(dtype, str) or dtype.lower() not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of: {', '.join(_DTYPES)}")
    return _DTYPES[dtype.lower()]


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4}


def parse_memory(value: int | str, field_name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1000000"``."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name}={value!r} must be a number of bytes or a string such as '2GiB'")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{field_name}={value!r} is not a memory size; use bytes (an int) or a number with one of the "
                f"units {', '.join(u for u in _UNITS if u)} (e.g. '2GiB')")
        nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{field_name}={value!r} must be an int (bytes) or a string such as '2GiB'")
    if nbytes <= 0:
        raise ValueError(f"{field_name}={value!r} must be positive")
    return nbytes


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling from the config's ``rope_scaling`` (or transformers 5's ``rope_parameters``).

    Supported: ``linear`` and ``llama3`` (scaled inverse frequencies), and ``longrope`` (Phi-3's LongRoPE, also
    spelled ``su``): ``short_factor`` and ``long_factor`` divide the inverse frequencies, one factor per
    rotary frequency, and cos/sin are multiplied by ``attention_factor``. Which positions use the long factors
    is :class:`kv8.layers.rotary.RotaryEmbedding`'s rule (positions ``>= original_max_position_embeddings``).

    Invariants for ``longrope``: ``short_factor`` and ``long_factor`` are non-empty, of equal length, positive
    and finite (their length is checked against the rotary dim by :meth:`check_rotary_dim`, which needs the
    model); ``attention_factor`` is finite and > 0.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    @staticmethod
    def from_hf_config(cfg: Mapping[str, Any]) -> RopeScaling | None:
        """The scaling of a whole Hugging Face config: its ``rope_scaling``, else its ``rope_parameters``
        (transformers 5 writes the scaling there, with ``rope_type`` ``default`` when there is none). For
        ``longrope`` the top-level ``original_max_position_embeddings`` and ``max_position_embeddings`` (Phi-3
        keeps them there) fill in what the dict lacks."""
        d = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if d is not None and not isinstance(d, Mapping):
            raise ValueError(f"model config rope_scaling={d!r} must be a JSON object")
        return RopeScaling.from_dict(d, cfg)

    @staticmethod
    def from_dict(d: Mapping[str, Any] | None, cfg: Mapping[str, Any] | None = None) -> RopeScaling | None:
        """``d`` is the ``rope_scaling`` dict; ``cfg`` the whole config (read by ``longrope`` only)."""
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type in (None, "default"):
            return None
        if rope_type == "su":   # Phi-3's early name for longrope (transformers renames it too)
            rope_type = "longrope"
        if rope_type == "longrope":
            return RopeScaling._longrope(d, cfg or {})
        if rope_type not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; kv8 supports: linear, llama3, "
                             "longrope")
        if d.get("factor") is None:
            raise ValueError(f"model config rope_scaling ({rope_type}) is missing the key 'factor'")
        factor = _cfg_float(d, "factor", 1.0)
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"model config rope_scaling factor={factor!r} must be a finite number > 0")
        return RopeScaling(
            rope_type=rope_type,
            factor=factor,
            low_freq_factor=_cfg_float(d, "low_freq_factor", 1.0),
            high_freq_factor=_cfg_float(d, "high_freq_factor", 4.0),
            original_max_position_embeddings=_cfg_int(d, "original_max_position_embeddings", 8192),
        )

    @staticmethod
    def _longrope(d: Mapping[str, Any], cfg: Mapping[str, Any]) -> RopeScaling:
        lists: dict[str, tuple[float, ...]] = {}
        for key in ("short_factor", "long_factor"):
            value = d.get(key)
            if not isinstance(value, (list, tuple)) or not value or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) for x in value):
                raise ValueError(f"model config rope_scaling (longrope) {key}={value!r} must be a non-empty list "
                                 "of numbers")
            bad = [x for x in value if not math.isfinite(x) or x <= 0]
            if bad:
                raise ValueError(f"model config rope_scaling (longrope) {key} has {bad[0]!r}; every factor must be "
                                 "a finite number > 0")
            lists[key] = tuple(float(x) for x in value)
        if len(lists["short_factor"]) != len(lists["long_factor"]):
            raise ValueError(f"model config rope_scaling (longrope) has {len(lists['short_factor'])} short_factor "
                             f"and {len(lists['long_factor'])} long_factor entries; they must be equally long")
        original_key = "original_max_position_embeddings"
        source = d if d.get(original_key) is not None else cfg
        if source.get(original_key) is None:
            raise ValueError(f"model config rope_scaling (longrope) needs {original_key} (in rope_scaling or at the "
                             "top level of the config)")
        original = _cfg_int(source, original_key)
        if original < 2:
            raise ValueError(f"model config {original_key}={original} must be an int >= 2")
        if d.get("factor") is not None:
            factor = _cfg_float(d, "factor", 1.0)
        else:   # Phi-3: the ratio of the extended to the original context
            factor = _cfg_int(cfg, "max_position_embeddings", original) / original
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"model config rope_scaling (longrope) factor={factor!r} must be a finite number > 0")
        if d.get("attention_factor") is not None:
            attention_factor = _cfg_float(d, "attention_factor", 1.0)
        else:   # LongRoPE's default: sqrt(1 + ln(factor) / ln(original)), 1.0 without extension
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        if not math.isfinite(attention_factor) or attention_factor <= 0:
            raise ValueError(f"model config rope_scaling (longrope) attention_factor={attention_factor!r} must be a "
                             "finite number > 0")
        return RopeScaling(rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                           short_factor=lists["short_factor"], long_factor=lists["long_factor"],
                           attention_factor=attention_factor)

    def check_rotary_dim(self, rotary_dim: int) -> None:
        """``ValueError`` unless the per-frequency factors (longrope) fit ``rotary_dim`` (rotary_dim / 2 each)."""
        if self.rope_type == "longrope" and len(self.short_factor) != rotary_dim // 2:
            raise ValueError(f"model config rope_scaling (longrope) short_factor and long_factor have "
                             f"{len(self.short_factor)} entries; this model rotates {rotary_dim} dims per head and "
                             f"needs {rotary_dim // 2} (rotary dim / 2)")


def _cfg_int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``cfg[key]`` as an int (a JSON null takes ``default``); ``ValueError`` naming the key otherwise."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"model config is missing the key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"model config {key}={value!r} must be an integer")
    return value


def _cfg_float(cfg: Mapping[str, Any], key: str, default: float) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"model config {key}={value!r} must be a number")
    return float(value)


LAYER_TYPES = ("full_attention", "sliding_attention")
# kv_cache_dtype_skip_layers entries besides layer indices: every layer of that kind stays in the compute dtype
SKIP_LAYER_KINDS = ("sliding_window", "full_attention")


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture of a decoder, the fields every model and the engine use.

    A model file whose architecture has more settings (Gemma 3's ``query_pre_attn_scalar``, ...) declares a
    subclass with those fields and names it in its class's ``arch_config_cls``; :meth:`from_hf_config` builds
    that subclass, adding the fields its :meth:`extra_fields` reads.

    Attention kinds per layer: ``layer_types[i]`` is ``"sliding_attention"`` (the layer attends to its last
    ``sliding_window`` tokens) or ``"full_attention"``. Invariants: ``num_heads % num_kv_heads == 0``;
    ``head_dim`` even; ``layer_types`` has ``num_layers`` entries from :data:`LAYER_TYPES`, and a sliding one
    only with ``sliding_window`` set.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, value in (("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size),
                            ("intermediate_size", self.intermediate_size), ("num_hidden_layers", self.num_layers),
                            ("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                            ("head_dim", self.head_dim), ("max_position_embeddings", self.max_position_embeddings),
                            *((("sliding_window", self.sliding_window),) if self.sliding_window is not None else ())):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {name}={value!r} must be an int >= 1")
        for name, fvalue in (("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta)):
            if not math.isfinite(fvalue) or fvalue <= 0:
                raise ValueError(f"model config {name}={fvalue!r} must be a finite number > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"model config layer_types={list(self.layer_types)!r} must list one of "
                             f"{', '.join(LAYER_TYPES)} for each of the {self.num_layers} layers")
        if self.sliding_window is None and "sliding_attention" in self.layer_types:
            raise ValueError("model config layer_types has sliding_attention layers but no sliding_window")

    def layer_type(self, layer: int) -> str:
        """``layer_types[layer]``; an empty ``layer_types`` means every layer is of the model's one kind
        (sliding when the model has a ``sliding_window``), without a tuple of ``num_layers`` entries."""
        if self.layer_types:
            return self.layer_types[layer]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def has_layer_type(self, kind: str) -> bool:
        return kind in self.layer_types if self.layer_types else self.layer_type(0) == kind

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: the layer attends to the whole context)."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's window (a tuple of ``num_layers``: call it once the layer count is checked against the
        checkpoint)."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @classmethod
    def extra_fields(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The values of the fields a subclass adds, read from the Hugging Face config (none here). A subclass
        may also return base fields its config spells differently (Gemma 3's per-layer-type ``rope_parameters``);
        those replace the generic reading."""
        return {}

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (all of them here; Phi-3's config can rotate fewer)."""
        return self.head_dim

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @staticmethod
    def from_hf_config(cfg: Mapping[str, Any]) -> ModelArchConfig:
        """Normalise a Hugging Face config.json dict into the config class of its model (``arch_config_cls``
        of the registered class). A model type without a registered model class, a missing key, or a value of
        the wrong type or range raises ``ValueError`` naming the key."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"the model config must be a JSON object, got {type(cfg).__name__}")
        from kv8.models.registry import arch_config_class, resolve_model_type  # the registry imports this module

        model_type = resolve_model_type(cfg)
        config_cls = arch_config_class(model_type)
        hidden, heads = _cfg_int(cfg, "hidden_size"), _cfg_int(cfg, "num_attention_heads")
        eos = cfg.get("eos_token_id")
        eos_list = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        if any(isinstance(e, bool) or not isinstance(e, int) for e in eos_list):
            raise ValueError(f"model config eos_token_id={eos!r} must be an int or a list of ints")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        rope_default = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        layer_types = cfg.get("layer_types")
        if layer_types is not None and not (isinstance(layer_types, list)
                                            and all(isinstance(t, str) for t in layer_types)):
            raise ValueError(f"model config layer_types={layer_types!r} must be a list of strings")
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=_cfg_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_cfg_int(cfg, "intermediate_size"),
            num_layers=_cfg_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_cfg_int(cfg, "num_key_value_heads", heads),
            head_dim=_cfg_int(cfg, "head_dim", hidden // heads if heads > 0 else 0),
            rms_norm_eps=_cfg_float(cfg, "rms_norm_eps", 1e-6),
            rope_theta=_cfg_float(cfg, "rope_theta", rope_default),
            rope_scaling=RopeScaling.from_hf_config(cfg),
            max_position_embeddings=_cfg_int(cfg, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos_list),
            sliding_window=_cfg_int(cfg, "sliding_window") if sliding else None,
            layer_types=tuple(layer_types or ()) if sliding else (),
        )
        fields.update(config_cls.extra_fields(cfg))   # a subclass's own fields, and base fields it reads its way
        return config_cls(**fields)

    def kv_bytes_per_token(self, kv_dtype: KVCacheDtype, dynamic_scales: bool = False) -> int:
        """Bytes one token occupies in the KV cache over all layers (K and V).

        With dynamic scales, each token also keeps one float32 scale per KV head for K and for V
        (``4 / head_dim`` overhead: 6.25% at head_dim 64).
        """
        per_head = KVCodec.bytes_per_head(kv_dtype, self.head_dim, dynamic_scales)
        return 2 * self.num_layers * self.num_kv_heads * per_head


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache settings.

    ``kv_cache_memory`` (bytes) or ``num_kv_blocks`` fixes the budget; with neither, the engine derives one
    from the machine's free memory (see :func:`default_kv_cache_memory`).

    ``scale_mode``: ``static`` -- per-layer scales (file, checkpoint, or 1.0); ``dynamic`` -- a scale per token
    and KV head, computed when the token is stored (``amax / format max``) and kept beside it (FP8 only).
    ``rotation``: ``hadamard`` -- K and V are multiplied by an orthonormal per-head Hadamard matrix before they
    are stored; the same matrix is folded into q and undone on the attention output, so attention is unchanged
    in exact arithmetic while outliers are spread across channels before rounding. Needs a power-of-two head_dim
    (checked by :class:`EngineConfig`, which knows the model).

    ``skip_layers`` (``kv_cache_dtype_skip_layers``): layer indices and :data:`SKIP_LAYER_KINDS` whose layers stay
    in the compute dtype while the rest are FP8. ``hybrid`` (off with ``disable_hybrid_kv_cache_manager``):
    sliding-window layers keep only the blocks inside their window; off, they keep every block (attention is
    windowed either way).

    Invariants: ``block_size`` is a power of two; at most one of ``kv_cache_memory`` (bytes) and
    ``num_kv_blocks`` is set, and it is an int >= 1; ``scale_mode`` in :data:`SCALE_MODES`, ``rotation`` in
    :data:`ROTATIONS`; dynamic scales and ``quantization_param_path`` need an FP8 ``kv_dtype`` and exclude each
    other.
    """

    kv_dtype: KVCacheDtype
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    quantization_param_path: str | None = None
    scale_mode: str = "static"
    rotation: str = "none"
    skip_layers: tuple[int | str, ...] = ()
    hybrid: bool = True

    @property
    def dynamic_scales(self) -> bool:
        return self.scale_mode == "dynamic"

    def __post_init__(self) -> None:
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"kv_cache_scale_mode={self.scale_mode!r} is not supported; choose one of: "
                             f"{', '.join(SCALE_MODES)}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"kv_cache_rotation={self.rotation!r} is not supported; choose one of: "
                             f"{', '.join(ROTATIONS)}")
        if self.dynamic_scales and not self.kv_dtype.is_fp8:
            raise ValueError(f"kv_cache_scale_mode='dynamic' needs an FP8 cache, but kv_cache_dtype="
                             f"{self.kv_dtype.name!r}; set kv_cache_dtype='fp8' (or another fp8 format)")
        if self.dynamic_scales and self.quantization_param_path is not None:
            raise ValueError("kv_cache_scale_mode='dynamic' computes scales per token; it cannot be combined "
                             f"with quantization_param_path={self.quantization_param_path!r} (drop one of them)")
        if (isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1
                or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size={self.block_size!r} must be a power of two >= 1 (e.g. 16)")
        for entry in self.skip_layers:
            if entry not in SKIP_LAYER_KINDS and (isinstance(entry, bool) or not isinstance(entry, int) or entry < 0):
                raise ValueError(f"kv_cache_dtype_skip_layers entry {entry!r} must be a layer index >= 0 or one of: "
                                 f"{', '.join(SKIP_LAYER_KINDS)}")
        if self.skip_layers and not self.kv_dtype.is_fp8:
            raise ValueError(f"kv_cache_dtype_skip_layers keeps layers out of an FP8 cache, but kv_cache_dtype="
                             f"{self.kv_dtype.name!r} is not FP8")
        if not isinstance(self.hybrid, bool):
            raise ValueError(f"disable_hybrid_kv_cache_manager={not self.hybrid!r} must be True or False")
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ValueError("give either kv_cache_memory or num_kv_blocks, not both")
        if self.kv_cache_memory is not None:
            _positive_int("kv_cache_memory", self.kv_cache_memory)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")
        if self.quantization_param_path is not None and not self.kv_dtype.is_fp8:
            raise ValueError(
                f"quantization_param_path={self.quantization_param_path!r} gives FP8 KV scales, but "
                f"kv_cache_dtype={self.kv_dtype.name!r} is not an FP8 format; set kv_cache_dtype='fp8' "
                "(or fp8_e4m3 / fp8_e4m3fnuz / fp8_e5m2) or drop quantization_param_path")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits.

    Invariant: ``max_num_batched_tokens >= 1``; a prompt longer than the per-step budget is prefilled in
    chunks (chunked prefill), so the budget never limits prompt length -- ``max_model_len`` does.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_model_len", self.max_model_len, minimum=2)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (:mod:`kv8.distributed`): ``tensor_parallel_size`` ranks, each running
    ``cpu_threads_per_rank`` torch threads (None: the machine's cores divided among the ranks; with one rank
    the process's setting is left alone). ``adaptive_cpu_threads``: a one-rank engine gives its parallel regions
    only the cores other processes leave free (:mod:`kv8.engine.threads`); ranks keep their threads.

    Invariants: both are ints >= 1 (or None for the threads); :meth:`check_model` -- called by
    :class:`EngineConfig` -- checks that the model's heads and MLP split over the ranks.
    """

    tensor_parallel_size: int = 1
    cpu_threads_per_rank: int | None = None
    adaptive_cpu_threads: bool = True

    def __post_init__(self) -> None:
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.cpu_threads_per_rank is not None:
            _positive_int("cpu_threads_per_rank", self.cpu_threads_per_rank)
        if not isinstance(self.adaptive_cpu_threads, bool):
            raise ValueError(f"adaptive_cpu_threads={self.adaptive_cpu_threads!r} must be True or False")

    def threads(self, cpu_count: int) -> int | None:
        """Torch threads of each rank on a machine of ``cpu_count`` cores (None: leave the setting alone)."""
        if self.cpu_threads_per_rank is not None:
            return self.cpu_threads_per_rank
        return None if self.tensor_parallel_size == 1 else max(1, cpu_count // self.tensor_parallel_size)

    def check_model(self, arch: ModelArchConfig) -> None:
        """``ValueError`` unless the model splits over ``tensor_parallel_size`` ranks: query heads and
        ``intermediate_size`` divisible by it; KV heads divisible by it or (replicated, as vLLM does) dividing
        it."""
        n = self.tensor_parallel_size
        if n == 1:
            return
        if arch.num_heads % n:
            raise ValueError(f"tensor_parallel_size={n} must divide the model's num_attention_heads="
                             f"{arch.num_heads}")
        if arch.num_kv_heads % n and n % arch.num_kv_heads:
            raise ValueError(f"tensor_parallel_size={n} must divide the model's num_key_value_heads="
                             f"{arch.num_kv_heads}, or be a multiple of it (KV heads are then replicated)")
        if arch.intermediate_size % n:
            raise ValueError(f"tensor_parallel_size={n} must divide the model's intermediate_size="
                             f"{arch.intermediate_size}")

    def kv_heads_per_rank(self, arch: ModelArchConfig) -> int:
        """KV heads in each rank's cache (one when they are replicated)."""
        return max(1, arch.num_kv_heads // self.tensor_parallel_size)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, validated. Built by :meth:`kv8.engine.args.EngineArgs.create_engine_config`.

    Invariants beyond those of its parts: ``attention_backend`` is in :data:`ATTENTION_BACKENDS`;
    ``dense_backend`` is in :data:`DENSE_BACKENDS` and usable with ``dtype``; ``quantization`` is None or in
    :data:`QUANTIZATION_METHODS`; ``max_model_len`` fits the
    model's context; ``kv_cache_dtype_skip_layers`` names layers the model has; a Hadamard rotation has a
    power-of-two ``head_dim``; ``seed`` is an int.
    """

    model: str
    model_kind: str  # "hf" or "gguf"
    arch: ModelArchConfig
    dtype: torch.dtype
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int = 0
    attention_backend: str = "auto"
    dense_backend: str = "auto"
    quantization: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not known; choose one of: "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        check_dense_backend(self.dense_backend, self.dtype)
        check_quantization(self.quantization)
        arch, max_len = self.arch, self.scheduler.max_model_len
        self.parallel.check_model(arch)
        if self.cache.rotation == "hadamard" and arch.head_dim & (arch.head_dim - 1):
            raise ValueError(f"kv_cache_rotation='hadamard' needs a power-of-two head_dim; this model has "
                             f"head_dim={arch.head_dim}")
        self.skipped_layers()   # validates kv_cache_dtype_skip_layers against the model
        if max_len > arch.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's context "
                             f"(max_position_embeddings={arch.max_position_embeddings})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in the cache of each tensor-parallel rank (the model's with one rank)."""
        return self.parallel.kv_heads_per_rank(self.arch)

    def skipped_layers(self) -> tuple[bool, ...]:
        """Per layer, whether ``kv_cache_dtype_skip_layers`` keeps it in the compute dtype (empty: none is)."""
        arch = self.arch
        if not self.cache.skip_layers:
            return ()
        skipped = [False] * arch.num_layers
        for entry in self.cache.skip_layers:
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
        return tuple(skipped)


def check_dense_backend(name: str, dtype: torch.dtype) -> None:
    """Raise ValueError unless ``name`` is one of :data:`DENSE_BACKENDS` and usable with compute ``dtype``.

    Called by :class:`EngineConfig`; a built config has passed it.
    """
    if name not in DENSE_BACKENDS:
        raise ValueError(f"dense_backend={name!r} is not known; choose one of: {', '.join(DENSE_BACKENDS)}")
    if name == "packed_bf16" and dtype != torch.bfloat16:
        raise ValueError(f"dense_backend='packed_bf16' needs dtype bfloat16, got {dtype}; use dense_backend='auto' "
                         f"or 'torch'")


def check_quantization(name: str | None) -> None:
    """Raise ValueError unless ``name`` is None (weights as the checkpoint has them) or one of
    :data:`QUANTIZATION_METHODS`."""
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={name!r} is not known; choose one of: {', '.join(QUANTIZATION_METHODS)} "
                         f"(or leave it unset for the checkpoint's weights)")


def blocks_for_memory(memory: int, arch: ModelArchConfig, kv_dtype: KVCacheDtype, block_size: int,
                      dynamic_scales: bool = False) -> int:
    """How many whole blocks fit in ``memory`` bytes."""
    return memory // (arch.kv_bytes_per_token(kv_dtype, dynamic_scales) * block_size)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to 8 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def default_kv_cache_memory() -> int:
    """Default KV budget: 25% of the memory available now, at most 4 GiB (vLLM's CPU default)."""
    return int(min(4 * 1024**3, 0.25 * available_memory()))


__all__ = [
    "ATTENTION_BACKENDS", "DENSE_BACKENDS", "DTYPE_CHOICES", "LAYER_TYPES", "QUANTIZATION_METHODS", "ROTATIONS",
    "SKIP_LAYER_KINDS", "SCALE_MODES", "CacheConfig", "EngineConfig", "ModelArchConfig", "ParallelConfig",
    "RopeScaling", "SchedulerConfig", "available_memory", "blocks_for_memory", "ceil_div", "check_dense_backend",
    "check_quantization", "default_kv_cache_memory", "format_bytes", "parse_memory", "resolve_dtype",
]
