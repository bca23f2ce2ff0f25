"""Where an engine's KV scales come from, and which source wins.

In order of precedence:

1. ``--quantization-param-path``: a vLLM or kv8 scales file (:func:`kv8.quant.scale_files.load_scales_file`);
2. scale tensors stored in the checkpoint (:func:`scales_from_checkpoint`);
3. the default 1.0, with one warning per :func:`resolve_kv_scales` call (that is, one per engine built).

Key offsets (key centering, :mod:`kv8.quant.key_offsets`) come only from a kv8 file passed as
``--quantization-param-path`` (:func:`engine_key_offsets`); with them the file is used by every cache format, its
static scales only by FP8 layers in static mode.

Tensor parallelism: each rank resolves its own scales. A vLLM file's ``scaling_factor[tp_rank]`` gives the
rank its per-layer scales; per-head or per-channel scales (kv8's file, the checkpoint) describe the whole model
and are cut to the rank's KV heads (:func:`engine_kv_scales`'s ``kv_heads``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from kv8.cache.config import CacheConfig
from kv8.cache.plan import KVSpec
from kv8.quant.formats import E4M3, E4M3FNUZ, E5M2, KVCacheDtype
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling
from kv8.quant.scale_files import load_key_offsets, load_key_scaling, load_scales_file
from kv8.quant.scales import TORCH_DTYPE_TO_FORMAT, KVScales, ModelScaleInfo, ScaleGranularity, check_fits

logger = logging.getLogger("kv8")

__all__ = ["engine_key_offsets", "engine_key_scaling", "engine_kv_scales", "is_kv_scale_name", "rank_heads",
           "resolve_kv_scales", "scales_from_checkpoint"]

_HOW_TO_GET_SCALES = (
    "run `kv8 calibrate` to compute per-layer scales and pass the resulting file with "
    "--quantization-param-path, or use a checkpoint that ships k_scale/v_scale tensors"
)


# --------------------------------------------------------------------------------------------------
# Checkpoint tensors
# --------------------------------------------------------------------------------------------------

# Accepted names (N = layer index), with the role each plays:
#   model.layers.N.self_attn.kv_scale             TGI legacy: one value for K and V
#   model.layers.N.self_attn.{k,v}_scale          TGI / vLLM
#   model.layers.N.self_attn.{k,v}_proj.{k,v}_scale         NVIDIA ModelOpt (vLLM remaps these)
#   model.layers.N.self_attn.{k,v}_proj.output_scale        compressed-tensors / llm-compressor and AMD Quark
#                                                           (vLLM CompressedTensorsConfig.get_cache_scale)
_SCALE_NAME = re.compile(
    r"model\.layers\.(?P<layer>[0-9]+)\.self_attn\."
    r"(?P<suffix>kv_scale|k_scale|v_scale|k_proj\.k_scale|v_proj\.v_scale|k_proj\.output_scale|v_proj\.output_scale)"
)
_SUFFIX_ROLE: dict[str, str] = {
    "kv_scale": "kv",
    "k_scale": "k",
    "v_scale": "v",
    "k_proj.k_scale": "k",
    "v_proj.v_scale": "v",
    "k_proj.output_scale": "k",
    "v_proj.output_scale": "v",
}


def is_kv_scale_name(name: str) -> bool:
    """True for checkpoint tensor names that carry KV-cache scales (see ``_SCALE_NAME`` for the list)."""
    return _SCALE_NAME.fullmatch(name) is not None


def _made_for_from_config(hf_config: Mapping[str, Any]) -> tuple[str, str]:
    """(fp8 format name the checkpoint's scales were made for, how that was decided)."""
    found: list[tuple[str, str]] = []
    value = hf_config.get("kv_cache_torch_dtype")
    if value is not None:
        if value not in TORCH_DTYPE_TO_FORMAT:
            raise ValueError(
                f"config kv_cache_torch_dtype is {value!r}; allowed: {sorted(TORCH_DTYPE_TO_FORMAT)}"
            )
        found.append((TORCH_DTYPE_TO_FORMAT[value], f"kv_cache_torch_dtype={value}"))
    qcfg = hf_config.get("quantization_config")
    scheme = qcfg.get("kv_cache_scheme") if isinstance(qcfg, Mapping) else None
    if scheme is not None:
        if not isinstance(scheme, Mapping):
            raise ValueError(f"config quantization_config.kv_cache_scheme must be an object, got {scheme!r}")
        kind, bits = scheme.get("type"), scheme.get("num_bits")
        if kind != "float" or bits != 8:
            raise ValueError(
                f"config quantization_config.kv_cache_scheme has type={kind!r}, num_bits={bits!r}; "
                "kv8 only understands fp8 KV scales (type='float', num_bits=8)"
            )
        found.append((E4M3.name, "quantization_config.kv_cache_scheme"))
    if not found:
        return E4M3.name, "assumed fp8_e4m3: config names no kv cache dtype"
    if len({fmt for fmt, _ in found}) > 1:
        raise ValueError(f"config disagrees about the KV scales' fp8 format: {found}")
    return found[0]


def _as_scale_vector(name: str, t: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A checkpoint scale tensor as float32 of shape [1] (scalar) or [num_kv_heads]."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"checkpoint tensor {name} is a {type(t).__name__}, expected a torch.Tensor")
    if not t.dtype.is_floating_point:
        raise ValueError(f"checkpoint tensor {name} has dtype {t.dtype}; KV scales must be floating point")
    shape = list(t.shape)
    if shape not in ([], [1], [num_kv_heads]):
        raise ValueError(
            f"checkpoint tensor {name} has shape {shape}; allowed: [], [1] or [num_kv_heads={num_kv_heads}]"
        )
    out = t.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    bad = ~(torch.isfinite(out) & (out > 0))
    if bool(bad.any()):
        raise ValueError(f"checkpoint tensor {name} holds {out.tolist()}; KV scales must be finite and > 0")
    return out


def scales_from_checkpoint(
    tensors: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], model: ModelScaleInfo
) -> KVScales | None:
    """KV scales stored in a checkpoint, or None when it has none.

    ``tensors`` may hold every checkpoint tensor; only names for which :func:`is_kv_scale_name` is true
    are looked at. Per layer, a ``k``/``v`` pair (any accepted spelling) wins over the legacy ``kv_scale``;
    a lone ``k`` or ``v`` is an error, as are two spellings of the same role with different values.
    Every layer must have scales if any has. Scalars and per-KV-head vectors may be mixed; then all
    layers are promoted to head granularity.

    ``made_for`` comes from the config: ``kv_cache_torch_dtype`` (TGI) or a compressed-tensors
    ``quantization_config.kv_cache_scheme`` with ``type="float", num_bits=8`` (E4M3FN). A config naming
    neither is assumed to mean fp8_e4m3 (what every known producer emits); the config is only checked
    when scale tensors are present.
    """
    by_layer: dict[int, dict[str, list[tuple[str, torch.Tensor]]]] = {}
    for name, t in tensors.items():
        m = _SCALE_NAME.fullmatch(name)
        if m is None:
            continue
        layer = int(m.group("layer"))
        role = _SUFFIX_ROLE[m.group("suffix")]
        by_layer.setdefault(layer, {}).setdefault(role, []).append(
            (name, _as_scale_vector(name, t, model.num_kv_heads))
        )
    if not by_layer:
        return None

    extra = sorted(i for i in by_layer if i >= model.num_layers)
    if extra:
        raise ValueError(f"checkpoint has KV scales for layer(s) {extra} but the model has {model.num_layers} layers")
    missing = [i for i in range(model.num_layers) if i not in by_layer]
    if missing:
        raise ValueError(
            f"checkpoint has KV scales for some layers but not for layer(s) {missing}; "
            "every layer needs scales when any has"
        )
    made_for, made_for_why = _made_for_from_config(hf_config)

    k_list: list[torch.Tensor] = []
    v_list: list[torch.Tensor] = []
    spellings: set[str] = set()
    for i in range(model.num_layers):
        roles = by_layer[i]
        picked: dict[str, torch.Tensor] = {}
        for role, entries in roles.items():
            first_name, first = entries[0]
            for other_name, other in entries[1:]:
                if other.shape != first.shape or not torch.equal(other, first):
                    raise ValueError(
                        f"layer {i}: checkpoint tensors {first_name} and {other_name} both give the "
                        f"{role} scale but differ ({first.tolist()} vs {other.tolist()})"
                    )
            picked[role] = first
        if ("k" in picked) != ("v" in picked):
            have, lack = ("k", "v") if "k" in picked else ("v", "k")
            raise ValueError(
                f"layer {i}: checkpoint has a {have} scale ({roles[have][0][0]}) but no {lack} scale"
            )
        used = ("k", "v") if "k" in picked else ("kv",)
        spellings.update(n.split(".self_attn.", 1)[1] for role in used for n, _ in roles[role])
        k_list.append(picked[used[0]])
        v_list.append(picked[used[-1]])

    per_head = any(t.numel() > 1 for t in k_list + v_list)
    if per_head:
        k = torch.stack([t.expand(model.num_kv_heads) for t in k_list]).unsqueeze(-1)
        v = torch.stack([t.expand(model.num_kv_heads) for t in v_list]).unsqueeze(-1)
        granularity = ScaleGranularity.HEAD
    else:
        k = torch.stack(k_list).reshape(-1, 1, 1)
        v = torch.stack(v_list).reshape(-1, 1, 1)
        granularity = ScaleGranularity.TENSOR
    return KVScales(
        k=k,
        v=v,
        granularity=granularity,
        source=f"checkpoint ({', '.join(sorted(spellings))}; {made_for_why})",
        made_for=made_for,
    )


# --------------------------------------------------------------------------------------------------
# Precedence
# --------------------------------------------------------------------------------------------------


def resolve_kv_scales(
    kv_dtype: KVCacheDtype,
    model: ModelScaleInfo,
    quantization_param_path: str | os.PathLike[str] | None,
    checkpoint_scales: KVScales | None,
    rotation: str = "none",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> KVScales | None:
    """The KV scales an engine should use, converted for the cache's fp8 format; None if not fp8.

    Precedence: ``quantization_param_path`` (a vLLM or kv8 JSON file, see :func:`load_scales_file`), then
    ``checkpoint_scales``, then 1.0. File or checkpoint scales must have been calibrated in the cache's
    ``rotation`` basis (ValueError otherwise); 1.0 fits any basis.
    Falling back to 1.0 logs one warning on logger ``"kv8"`` per call. Engines call this once per
    construction, so every engine built without scales warns once; it is deliberately not deduplicated
    per process, since a second engine may load a different model. A ``quantization_param_path`` with a
    non-fp8 cache raises ValueError, because the scales would be silently ignored.
    """
    if not kv_dtype.is_fp8:
        if quantization_param_path is not None:
            raise ValueError(
                f"quantization_param_path={os.fspath(quantization_param_path)!r} was given but kv_cache_dtype is "
                f"{kv_dtype.name!r}, so the scales would be ignored; set kv_cache_dtype to an fp8 format "
                "(e.g. fp8_e4m3) or drop quantization_param_path"
            )
        return None
    fmt = kv_dtype.fp8
    assert fmt is not None  # is_fp8 guarantees it
    if quantization_param_path is not None:
        scales = load_scales_file(quantization_param_path, model, tp_rank, tp_size)
    elif checkpoint_scales is not None:
        scales = checkpoint_scales
    else:
        logger.warning(
            "Using KV cache scaling factor 1.0 for every layer of the %s cache (no --quantization-param-path "
            "and no scales in the checkpoint); accuracy may suffer. To get scales, %s.",
            fmt.name,
            _HOW_TO_GET_SCALES,
        )
        return KVScales.default(model.num_layers)
    check_fits(scales, model)
    if scales.rotation != rotation:
        raise ValueError(
            f"the static KV scales from {scales.source} were calibrated with rotation {scales.rotation!r}, but "
            f"kv_cache_rotation={rotation!r}; calibrate with `kv8 calibrate --kv-cache-rotation {rotation}`, use "
            "kv_cache_scale_mode='dynamic', or drop the scales (1.0)")
    if fmt.name == E5M2.name and scales.made_for in (E4M3.name, E4M3FNUZ.name):
        logger.warning(
            "the KV scales from %s were calibrated for %s but the cache stores %s; they are used unchanged (E5M2 "
            "has a wider range and fewer mantissa bits, so they fit, but are not tuned for it). For scales made "
            "for this cache run `kv8 calibrate --kv-cache-dtype fp8_e5m2`.", scales.source, scales.made_for, fmt.name)
    return scales.for_format(fmt)


def engine_kv_scales(cache: CacheConfig, model: ModelScaleInfo, checkpoint_tensors: Mapping[str, torch.Tensor],
                     hf_config: Mapping[str, Any], tp_rank: int = 0, tp_size: int = 1,
                     kv_heads: tuple[int, int] | None = None, spec: KVSpec | None = None) -> KVScales | None:
    """The static scales of the layers an engine with cache settings ``cache`` stores in ``spec`` (default: the
    cache's own, :attr:`CacheConfig.default_spec`; a plan's pools ask one by one): None unless ``spec`` is FP8 in
    static mode (with dynamic scales the checkpoint's static scales are not used, which is logged), else
    :func:`resolve_kv_scales` over the file, the checkpoint's scale tensors and 1.0, which checks that they were
    calibrated in ``spec``'s rotation. For tensor-parallel rank ``tp_rank`` of ``tp_size`` holding KV heads
    ``kv_heads = (first, count)`` of ``model``: that rank's scales, per-head and per-channel ones cut to its heads.
    The scales cover every layer; a pool's codec reads only its own layers'."""
    spec = spec or cache.default_spec
    ckpt = scales_from_checkpoint(checkpoint_tensors, hf_config, model) if checkpoint_tensors else None
    if spec.dynamic:
        if ckpt is not None:
            logger.info("dynamic KV scales (%s): the checkpoint's static scales (%s) are not used", spec.describe(),
                        ckpt.source)
        return None
    path = cache.quantization_param_path if spec.kv_dtype.is_fp8 else None   # a plan's other layers: no scales
    scales = resolve_kv_scales(spec.kv_dtype, model, path, ckpt, spec.rotation, tp_rank, tp_size)
    return scales if scales is None or kv_heads is None else rank_heads(scales, *kv_heads)


def engine_key_offsets(cache: CacheConfig, model: ModelScaleInfo,
                       kv_heads: tuple[int, int] | None = None) -> KeyOffsets | None:
    """The key offsets an engine with cache settings ``cache`` centers its keys by: those of the
    ``quantization_param_path`` file when it has them (:func:`kv8.quant.scale_files.load_key_offsets`, validated
    against ``model``), cut to the KV heads ``kv_heads = (first, count)`` of a tensor-parallel rank; None without.
    They apply to every layer and pool, whatever its format (a 16/32-bit pool included, where centering changes
    nothing but rounding). When the file's static scales are not used by the cache's own format (not FP8, or
    dynamic scales) that is logged once, here."""
    path = cache.quantization_param_path
    if path is None:
        return None
    offsets = load_key_offsets(path, model)
    if offsets is None:
        return None
    if not cache.default_spec.static_fp8 and cache.kv_cache_plan is None:
        logger.info("key centering from %s; its static scales are not used by a %s cache (%s)", path,
                    cache.default_spec.describe(), "scales per token and head" if cache.dynamic_scales
                    else "not FP8")
    return offsets if kv_heads is None else offsets.heads(*kv_heads)


def engine_key_scaling(cache: CacheConfig, model: ModelScaleInfo,
                       kv_heads: tuple[int, int] | None = None) -> KeyScaling | None:
    """The key factors (key scaling, :mod:`kv8.quant.key_scaling`) of the ``quantization_param_path`` file when it
    has them (:func:`kv8.quant.scale_files.load_key_scaling`, validated against ``model``), cut to the KV heads
    ``kv_heads = (first, count)`` of a tensor-parallel rank; None without. Like the key offsets they come with,
    they apply to every layer and pool (each pool's codec refuses them where it stores static-scale FP8)."""
    path = cache.quantization_param_path
    if path is None:
        return None
    scaling = load_key_scaling(path, model)
    if scaling is None:
        return None
    return scaling if kv_heads is None else scaling.heads(*kv_heads)


def rank_heads(scales: KVScales, first: int, count: int) -> KVScales:
    """``scales`` for KV heads ``first .. first + count - 1`` only (per-layer scales are returned unchanged)."""
    if scales.k.shape[1] == 1:
        return scales
    return KVScales(k=scales.k[:, first:first + count], v=scales.v[:, first:first + count],
                    granularity=scales.granularity, source=f"{scales.source}, KV heads {first}..{first + count - 1}",
                    made_for=scales.made_for, rotation=scales.rotation)
