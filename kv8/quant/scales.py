"""KV-cache scaling factors: where they come from, how they are validated, which one wins.

An fp8 KV cache stores ``saturate(rne(x / scale))`` and reads back ``stored * scale``. One scale per
layer (or per layer and KV head) for K and one for V. Scales come from, in order of precedence:

1. ``--quantization-param-path``: a vLLM ``kv_cache_scales.json`` file (:func:`load_vllm_scales_json`) or a
   kv8 scales file (:func:`load_kv8_scales_json`), told apart by content (:func:`load_scales_file`);
2. scale tensors stored in the checkpoint (:func:`scales_from_checkpoint`);
3. the default 1.0, with one warning per :func:`resolve_kv_scales` call (that is, one per engine built).

Scales are computed for a specific fp8 format. E4M3FNUZ (ROCm) has the same bit patterns as E4M3FN but
an exponent bias one higher, so every value is half as large: scales made for one are converted for the
other by a factor of 2 (:meth:`KVScales.for_format`), as vLLM and TGI do on ROCm.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from kv8.quant.formats import E4M3, E4M3FNUZ, E5M2, FP8Format, KVCacheDtype
from kv8.quant.rotation import ROTATIONS

logger = logging.getLogger("kv8")

__all__ = [
    "KVScales",
    "ModelScaleInfo",
    "ScaleGranularity",
    "is_kv_scale_name",
    "load_kv8_scales_json",
    "load_scales_file",
    "load_vllm_scales_json",
    "resolve_kv_scales",
    "scales_from_checkpoint",
    "write_kv8_scales_json",
    "write_vllm_scales_json",
]

# torch dtype names used by vLLM JSON files and HF configs -> kv8 fp8 format names.
_TORCH_DTYPE_TO_FORMAT: dict[str, str] = {
    "float8_e4m3fn": E4M3.name,
    "float8_e4m3fnuz": E4M3FNUZ.name,
}
_FORMAT_TO_TORCH_DTYPE: dict[str, str] = {v: k for k, v in _TORCH_DTYPE_TO_FORMAT.items()}

_HOW_TO_GET_SCALES = (
    "run `kv8 calibrate` to compute per-layer scales and pass the resulting file with "
    "--quantization-param-path, or use a checkpoint that ships k_scale/v_scale tensors"
)


class ScaleGranularity(str, Enum):
    """How finely a KV scale tensor is resolved within one layer."""

    TENSOR = "tensor"  # one scale per layer: [L, 1, 1]
    HEAD = "head"  # one scale per layer and KV head: [L, H, 1]
    CHANNEL = "channel"  # one scale per layer, KV head and channel: [L, H, D] (reserved, representable)


@dataclass(frozen=True, eq=False)
class KVScales:
    """Per-layer K and V scales.

    Invariants (checked in ``__post_init__``): ``k`` and ``v`` are float32 CPU tensors of equal shape,
    finite and > 0, with ndim 3 and shape ``[num_layers, 1, 1]`` (tensor), ``[num_layers, H, 1]`` (head)
    or ``[num_layers, H, D]`` (channel), so ``k[i]`` broadcasts against a ``[num_kv_heads, head_dim]``
    slice of layer ``i``'s keys. ``stored = saturate(rne(x / scale))``; ``read = stored * scale``.
    The tensors are private copies of what was passed in, so later mutation of the caller's tensors
    cannot break the invariants; do not mutate ``k``/``v`` in place.
    """

    k: torch.Tensor
    v: torch.Tensor
    granularity: ScaleGranularity
    source: str
    made_for: str | None
    # The basis the scales describe: "none", or "hadamard" for scales calibrated on K/V rotated as
    # kv_cache_rotation="hadamard" stores them (only kv8's JSON schema can carry it).
    rotation: str = "none"

    def __post_init__(self) -> None:
        if self.rotation not in ROTATIONS:
            raise ValueError(f"KVScales.rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        if not isinstance(self.granularity, ScaleGranularity):
            raise ValueError(
                f"KVScales.granularity must be a ScaleGranularity, got {self.granularity!r}; "
                f"allowed: {[g.value for g in ScaleGranularity]}"
            )
        allowed_made_for = (None, E4M3.name, E4M3FNUZ.name, E5M2.name)
        if self.made_for not in allowed_made_for:
            raise ValueError(f"KVScales.made_for must be one of {allowed_made_for}, got {self.made_for!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"KVScales.source must be a non-empty string, got {self.source!r}")
        for name in ("k", "v"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"KVScales.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise ValueError(f"KVScales.{name} must be float32, got {t.dtype}")
            if t.device.type != "cpu":
                raise ValueError(f"KVScales.{name} must be on the CPU, got device {t.device}")
            if t.ndim != 3 or t.shape[0] < 1:
                raise ValueError(
                    f"KVScales.{name} must have shape [num_layers>=1, H or 1, D or 1], got {list(t.shape)}"
                )
        if self.k.shape != self.v.shape:
            raise ValueError(f"KVScales.k shape {list(self.k.shape)} != KVScales.v shape {list(self.v.shape)}")
        _, h, d = self.k.shape
        if self.granularity is ScaleGranularity.TENSOR and (h, d) != (1, 1):
            raise ValueError(f"tensor-granularity KVScales need shape [L, 1, 1], got {list(self.k.shape)}")
        if self.granularity is ScaleGranularity.HEAD and d != 1:
            raise ValueError(f"head-granularity KVScales need shape [L, H, 1], got {list(self.k.shape)}")
        for name in ("k", "v"):
            t = getattr(self, name)
            bad = ~(torch.isfinite(t) & (t > 0))
            if bool(bad.any()):
                layer, head, chan = (int(x) for x in bad.nonzero()[0])
                value = float(t[layer, head, chan])
                raise ValueError(
                    f"KVScales.{name} scale for layer {layer} (head {head}, channel {chan}) is {value!r}; "
                    f"scales must be finite and > 0 ({self.source})"
                )
        object.__setattr__(self, "k", self.k.detach().clone().contiguous())
        object.__setattr__(self, "v", self.v.detach().clone().contiguous())

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) scales of layer ``i``, each of shape [H or 1, D or 1]."""
        if not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise ValueError(f"layer index must be an int in [0, {self.num_layers}), got {i!r}")
        return self.k[i], self.v[i]

    def for_format(self, fmt: FP8Format) -> KVScales:
        """The scales to use with a cache stored in ``fmt``.

        E4M3FN-made scales used with E4M3FNUZ are multiplied by 2, FNUZ-made scales used with E4M3FN are
        halved (an FNUZ bit pattern means half the E4M3FN value). Every other combination, including
        ``made_for=None`` and E5M2, is returned unchanged.
        """
        if self.made_for == E4M3.name and fmt.name == E4M3FNUZ.name:
            factor, note = 2.0, "x2"
        elif self.made_for == E4M3FNUZ.name and fmt.name == E4M3.name:
            factor, note = 0.5, "/2"
        else:
            return self
        return KVScales(
            k=self.k * factor,
            v=self.v * factor,
            granularity=self.granularity,
            source=f"{self.source}, {note} for {fmt.name}",
            made_for=fmt.name,
            rotation=self.rotation,
        )

    @staticmethod
    def default(num_layers: int) -> KVScales:
        """All-ones tensor-granularity scales for ``num_layers`` layers."""
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        ones = torch.ones(num_layers, 1, 1, dtype=torch.float32)
        return KVScales(k=ones, v=ones, granularity=ScaleGranularity.TENSOR, source="default 1.0", made_for=None)


@dataclass(frozen=True)
class ModelScaleInfo:
    """What the scales loaders need to know about the model. All counts are >= 1."""

    model_type: str  # HF config model_type, e.g. "llama", "qwen2"
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ValueError(f"ModelScaleInfo.model_type must be a non-empty string, got {self.model_type!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelScaleInfo.{name} must be an int >= 1, got {value!r}")


# --------------------------------------------------------------------------------------------------
# vLLM kv_cache_scales.json
# --------------------------------------------------------------------------------------------------


def _int_key(key: Any, what: str, where: str) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        value = key
    elif isinstance(key, str) and re.fullmatch(r"[0-9]+", key):
        value = int(key)
    else:
        raise ValueError(f"{where}: {what} key {key!r} is not a non-negative integer")
    if value < 0:
        raise ValueError(f"{where}: {what} key {key!r} is negative")
    return value


def _int_keyed(mapping: Mapping[Any, Any], what: str, where: str) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for key, value in mapping.items():
        index = _int_key(key, what, where)
        if index in out:
            raise ValueError(f"{where}: {what} {index} appears twice (key {key!r})")
        out[index] = value
    return out


def load_vllm_scales_json(
    path: str | os.PathLike[str], model: ModelScaleInfo, tp_rank: int = 0, tp_size: int = 1
) -> KVScales:
    """Load a vLLM ``kv_cache_scales.json`` file for ``model``.

    Schema: ``{"model_type": str, "kv_cache": {"dtype": "float8_e4m3fn" | "float8_e4m3fnuz",
    "scaling_factor": {tp_rank: {layer: float}}}}`` with integer keys written as strings. Validated as
    vLLM does (the file must hold exactly ``tp_size`` ranks, ``model_type`` must match, the rank must have
    exactly ``model.num_layers`` layers, all of ``0..num_layers-1``) plus: every scale must be a finite
    number > 0. Unlike vLLM, which logs and falls back to 1.0, every problem raises ValueError naming the
    file. The one scale per layer is used for both K and V (tensor granularity).
    """
    where = os.fspath(path)
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if tp_rank >= tp_size:
        raise ValueError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read KV cache scales file: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not a valid JSON KV cache scales file: {e}") from e

    if not isinstance(data, dict):
        raise ValueError(f"{where}: top level must be a JSON object, got {type(data).__name__}")
    for key in ("model_type", "kv_cache"):
        if key not in data:
            raise ValueError(f"{where}: missing key {key!r} (expected keys 'model_type' and 'kv_cache')")
    if data["model_type"] != model.model_type:
        raise ValueError(
            f"{where}: scales were computed for model_type {data['model_type']!r} but the model is "
            f"{model.model_type!r}"
        )
    kv = data["kv_cache"]
    if not isinstance(kv, dict):
        raise ValueError(f"{where}: 'kv_cache' must be an object, got {type(kv).__name__}")
    for key in ("dtype", "scaling_factor"):
        if key not in kv:
            raise ValueError(f"{where}: missing key 'kv_cache.{key}'")
    dtype = kv["dtype"]
    if dtype not in _TORCH_DTYPE_TO_FORMAT:
        raise ValueError(
            f"{where}: kv_cache.dtype is {dtype!r}; vLLM scale files are only defined for "
            f"{sorted(_TORCH_DTYPE_TO_FORMAT)}"
        )
    if not isinstance(kv["scaling_factor"], dict):
        raise ValueError(f"{where}: 'kv_cache.scaling_factor' must be an object keyed by TP rank")
    ranks = _int_keyed(kv["scaling_factor"], "TP rank", where)
    if len(ranks) != tp_size:
        raise ValueError(
            f"{where}: file holds scales for {len(ranks)} TP rank(s) {sorted(ranks)} but kv8 runs with "
            f"tensor-parallel size {tp_size}"
        )
    if tp_rank not in ranks:
        raise ValueError(f"{where}: no scales for TP rank {tp_rank} (ranks present: {sorted(ranks)})")
    if not isinstance(ranks[tp_rank], dict):
        raise ValueError(f"{where}: scaling_factor[{tp_rank}] must be an object keyed by layer index")
    layers = _int_keyed(ranks[tp_rank], "layer", where)
    if len(layers) != model.num_layers:
        raise ValueError(
            f"{where}: file has scales for {len(layers)} layers but the model has {model.num_layers} layers"
        )
    missing = [i for i in range(model.num_layers) if i not in layers]
    if missing:
        raise ValueError(
            f"{where}: no scale for layer(s) {missing} in TP rank {tp_rank} "
            f"(unexpected layer keys: {sorted(i for i in layers if i >= model.num_layers)})"
        )
    values: list[float] = []
    for i in range(model.num_layers):
        raw = layers[i]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ValueError(f"{where}: scale for layer {i} is {raw!r}; expected a number")
        if not math.isfinite(raw) or raw <= 0:
            raise ValueError(f"{where}: scale for layer {i} is {raw!r}; scales must be finite and > 0")
        values.append(float(raw))
    scales = torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1)
    if not bool((torch.isfinite(scales) & (scales > 0)).all()):
        bad = int((~(torch.isfinite(scales) & (scales > 0))).nonzero()[0, 0])
        raise ValueError(f"{where}: scale for layer {bad} ({values[bad]!r}) is not representable as float32 > 0")
    return KVScales(
        k=scales,
        v=scales,
        granularity=ScaleGranularity.TENSOR,
        source=f"quantization_param_path {where}",
        made_for=_TORCH_DTYPE_TO_FORMAT[dtype],
    )


def write_vllm_scales_json(path: str | os.PathLike[str], scales: KVScales, model_type: str) -> None:
    """Write tensor-granularity scales with K == V as a single-rank vLLM ``kv_cache_scales.json``.

    The vLLM format holds one scale per layer for both K and V and is defined only for E4M3FN/E4M3FNUZ,
    so ``scales`` must have tensor granularity, identical K and V, and ``made_for`` fp8_e4m3(fnuz).
    """
    if scales.granularity is not ScaleGranularity.TENSOR:
        raise ValueError(f"vLLM scale files hold one scale per layer; got {scales.granularity.value} granularity")
    if scales.rotation != "none":
        raise ValueError(f"vLLM scale files cannot say that scales were calibrated on {scales.rotation}-rotated "
                         "K/V; write kv8's JSON schema instead")
    if not torch.equal(scales.k, scales.v):
        raise ValueError("vLLM scale files hold one scale per layer for both K and V; k and v differ")
    if scales.made_for not in _FORMAT_TO_TORCH_DTYPE:
        raise ValueError(
            f"vLLM scale files are only defined for {sorted(_FORMAT_TO_TORCH_DTYPE)}; made_for is {scales.made_for!r}"
        )
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty string, got {model_type!r}")
    per_layer = {str(i): float(scales.k[i, 0, 0]) for i in range(scales.num_layers)}
    doc = {
        "model_type": model_type,
        "kv_cache": {"dtype": _FORMAT_TO_TORCH_DTYPE[scales.made_for], "scaling_factor": {"0": per_layer}},
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=4)
        f.write("\n")


# --------------------------------------------------------------------------------------------------
# kv8 scales JSON (any granularity, separate K and V, any fp8 format)
# --------------------------------------------------------------------------------------------------

KV8_SCALES_FORMAT = "kv8-kv-scales"
KV8_SCALES_VERSION = 1


def _read_json(path: str | os.PathLike[str]) -> Any:
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read KV cache scales file: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not a valid JSON KV cache scales file: {e}") from e


def write_kv8_scales_json(path: str | os.PathLike[str], scales: KVScales, model: ModelScaleInfo) -> None:
    """Write ``scales`` in the kv8 schema::

        {"format": "kv8-kv-scales", "version": 1, "model_type": str, "num_layers": L, "num_kv_heads": H,
         "head_dim": D, "granularity": "tensor" | "head" | "channel", "made_for": fp8 format name | null,
         "rotation": "none" | "hadamard", "k": [[[float]]], "v": [[[float]]]}

    ``rotation`` (absent means ``"none"``) names the basis the scales were calibrated in: a cache must use the
    same ``kv_cache_rotation``.

    ``k``/``v`` are nested lists of shape ``[L, 1, 1]``, ``[L, H, 1]`` or ``[L, H, D]`` (the KVScales shape).
    """
    _check_fits(scales, model)
    doc = {
        "format": KV8_SCALES_FORMAT, "version": KV8_SCALES_VERSION, "model_type": model.model_type,
        "num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
        "granularity": scales.granularity.value, "made_for": scales.made_for, "rotation": scales.rotation,
        "k": scales.k.tolist(), "v": scales.v.tolist(),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.write("\n")


def _kv8_scales_from_doc(data: dict[str, Any], where: str, model: ModelScaleInfo) -> KVScales:
    if data.get("version") != KV8_SCALES_VERSION:
        raise ValueError(f"{where}: kv8 scales file version is {data.get('version')!r}; kv8 reads version "
                         f"{KV8_SCALES_VERSION}")
    expected = {"model_type": model.model_type, "num_layers": model.num_layers,
                "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
    for key, want in expected.items():
        if data.get(key) != want:
            raise ValueError(f"{where}: {key} is {data.get(key)!r} but the model has {key}={want!r}")
    try:
        granularity = ScaleGranularity(data.get("granularity"))
    except ValueError:
        raise ValueError(f"{where}: granularity is {data.get('granularity')!r}; allowed: "
                         f"{[g.value for g in ScaleGranularity]}") from None
    tensors: dict[str, torch.Tensor] = {}
    for name in ("k", "v"):
        raw = data.get(name)
        ok = isinstance(raw, list) and all(
            isinstance(h, list) and all(isinstance(c, list) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in c) for c in h) for h in raw)
        if not ok:
            raise ValueError(f"{where}: '{name}' must be a nested list of numbers [layers][heads][channels]")
        try:
            tensors[name] = torch.tensor(raw, dtype=torch.float32)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: '{name}' is not a rectangular [layers][heads][channels] list: {e}") from None
    try:
        scales = KVScales(k=tensors["k"], v=tensors["v"], granularity=granularity,
                          source=f"quantization_param_path {where}", made_for=data.get("made_for"),
                          rotation=data.get("rotation", "none"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    _check_fits(scales, model)
    return scales


def load_kv8_scales_json(path: str | os.PathLike[str], model: ModelScaleInfo) -> KVScales:
    """Load a kv8 scales file (schema in :func:`write_kv8_scales_json`) for ``model``; model_type, layer,
    head and head_dim counts must match, and the scales must satisfy every :class:`KVScales` invariant."""
    where = os.fspath(path)
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("format") != KV8_SCALES_FORMAT:
        raise ValueError(f"{where}: not a kv8 scales file (expected a JSON object with "
                         f"\"format\": \"{KV8_SCALES_FORMAT}\")")
    return _kv8_scales_from_doc(data, where, model)


def load_scales_file(path: str | os.PathLike[str], model: ModelScaleInfo) -> KVScales:
    """Load a ``quantization_param_path``: a kv8 scales file (``"format": "kv8-kv-scales"``) or else a
    vLLM ``kv_cache_scales.json``, decided by the file's content."""
    data = _read_json(path)
    if isinstance(data, dict) and data.get("format") == KV8_SCALES_FORMAT:
        return _kv8_scales_from_doc(data, os.fspath(path), model)
    return load_vllm_scales_json(path, model)


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
        if value not in _TORCH_DTYPE_TO_FORMAT:
            raise ValueError(
                f"config kv_cache_torch_dtype is {value!r}; allowed: {sorted(_TORCH_DTYPE_TO_FORMAT)}"
            )
        found.append((_TORCH_DTYPE_TO_FORMAT[value], f"kv_cache_torch_dtype={value}"))
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


def _check_fits(scales: KVScales, model: ModelScaleInfo) -> None:
    _, h, d = scales.k.shape
    if scales.num_layers != model.num_layers:
        raise ValueError(
            f"KV scales from {scales.source} cover {scales.num_layers} layers but the model has {model.num_layers}"
        )
    if h not in (1, model.num_kv_heads) or d not in (1, model.head_dim):
        raise ValueError(
            f"KV scales from {scales.source} have shape {list(scales.k.shape)}, which does not broadcast "
            f"against [num_kv_heads={model.num_kv_heads}, head_dim={model.head_dim}]"
        )


def resolve_kv_scales(
    kv_dtype: KVCacheDtype,
    model: ModelScaleInfo,
    quantization_param_path: str | os.PathLike[str] | None,
    checkpoint_scales: KVScales | None,
    rotation: str = "none",
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
        scales = load_scales_file(quantization_param_path, model)
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
    _check_fits(scales, model)
    if scales.rotation != rotation:
        raise ValueError(
            f"the static KV scales from {scales.source} were calibrated with rotation {scales.rotation!r}, but "
            f"kv_cache_rotation={rotation!r}; calibrate with `kv8 calibrate --kv-cache-rotation {rotation}`, use "
            "kv_cache_scale_mode='dynamic', or drop the scales (1.0)")
    return scales.for_format(fmt)
