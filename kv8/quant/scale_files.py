"""KV scale files: vLLM's ``kv_cache_scales.json`` and kv8's own JSON schema (read and write).

``--quantization-param-path`` takes either; :func:`load_scales_file` tells them apart by content. vLLM's schema
holds one scale per layer and tensor-parallel rank, used for K and V alike; kv8's holds K and V separately at
tensor, head or channel granularity and records the basis (rotation) the scales describe.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling
from kv8.quant.scales import (
    FORMAT_TO_TORCH_DTYPE,
    TORCH_DTYPE_TO_FORMAT,
    KVScales,
    ModelScaleInfo,
    ScaleGranularity,
    check_fits,
)
from kv8.validators import is_number

__all__ = ["file_has_key_offsets", "file_has_key_scaling", "load_key_offsets", "load_key_scaling",
           "load_kv8_scales_json", "load_scales_file", "load_vllm_scales_json", "write_kv8_scales_json",
           "write_vllm_scales_json"]

_PerChannel = TypeVar("_PerChannel", KeyOffsets, KeyScaling)   # a per (layer, KV head, channel) field

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
    data = _read_json(path)
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
    if dtype not in TORCH_DTYPE_TO_FORMAT:
        raise ValueError(
            f"{where}: kv_cache.dtype is {dtype!r}; vLLM scale files are only defined for "
            f"{sorted(TORCH_DTYPE_TO_FORMAT)}"
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
        if not is_number(raw):
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
        made_for=TORCH_DTYPE_TO_FORMAT[dtype],
    )


def write_vllm_scales_json(path: str | os.PathLike[str], scales: KVScales | Sequence[KVScales],
                           model_type: str) -> None:
    """Write tensor-granularity scales with K == V as a vLLM ``kv_cache_scales.json``.

    ``scales`` is one :class:`KVScales` (a single-rank file) or one per tensor-parallel rank, in rank order
    (``scaling_factor[tp_rank]``, which an engine with that many ranks reads). The vLLM format holds one scale
    per layer for both K and V and is defined only for E4M3FN/E4M3FNUZ, so every entry must have tensor
    granularity, identical K and V, no rotation, and the same ``made_for`` (fp8_e4m3[fnuz]) and layer count.
    """
    ranks = [scales] if isinstance(scales, KVScales) else list(scales)
    if not ranks:
        raise ValueError("no scales to write: give one KVScales per tensor-parallel rank")
    for r, s in enumerate(ranks):
        at = f" (rank {r})" if len(ranks) > 1 else ""
        if s.granularity is not ScaleGranularity.TENSOR:
            raise ValueError(f"vLLM scale files hold one scale per layer; got {s.granularity.value} granularity{at}")
        if s.rotation != "none":
            raise ValueError(f"vLLM scale files cannot say that scales were calibrated on {s.rotation}-rotated "
                             f"K/V{at}; write kv8's JSON schema instead")
        if not torch.equal(s.k, s.v):
            raise ValueError(f"vLLM scale files hold one scale per layer for both K and V; k and v differ{at}")
        if s.made_for not in FORMAT_TO_TORCH_DTYPE:
            raise ValueError(f"vLLM scale files are only defined for {sorted(FORMAT_TO_TORCH_DTYPE)}; made_for is "
                             f"{s.made_for!r}{at}")
        if (s.made_for, s.num_layers) != (ranks[0].made_for, ranks[0].num_layers):
            raise ValueError(f"every rank's scales must be for the same format and layer count: rank 0 has "
                             f"{ranks[0].made_for} x {ranks[0].num_layers} layers, rank {r} {s.made_for} x "
                             f"{s.num_layers}")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty string, got {model_type!r}")
    doc = {
        "model_type": model_type,
        "kv_cache": {
            "dtype": FORMAT_TO_TORCH_DTYPE[str(ranks[0].made_for)],
            "scaling_factor": {str(r): {str(i): float(s.k[i, 0, 0]) for i in range(s.num_layers)}
                               for r, s in enumerate(ranks)},
        },
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=4)
        f.write("\n")


# --------------------------------------------------------------------------------------------------
# kv8 scales JSON (any granularity, separate K and V, any fp8 format)
# --------------------------------------------------------------------------------------------------

KV8_SCALES_FORMAT = "kv8-kv-scales"
KV8_SCALES_VERSION = 1
# version 2 adds "k_offset" (key centering): a reader that only knows version 1 refuses such a file instead of using
# scales calibrated on centered keys without centering them
KV8_OFFSETS_VERSION = 2
# version 3 adds "k_channel_scale" (key scaling, only beside "k_offset"): a version-2 reader refuses it instead of
# centering the keys without scaling them (harmless for attention, but not what the file's author measured)
KV8_KEY_SCALING_VERSION = 3
KV8_SCALES_VERSIONS = (KV8_SCALES_VERSION, KV8_OFFSETS_VERSION, KV8_KEY_SCALING_VERSION)


def _read_json(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of a scales file; ``ValueError`` naming the file when it cannot be read or parsed (nesting
    deeper than Python's recursion limit included: a scales file is a few levels deep)."""
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read KV cache scales file: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not a valid JSON KV cache scales file: {e}") from e
    except RecursionError:
        raise ValueError(f"{where}: not a KV cache scales file: its JSON is nested too deeply to parse (a scales "
                         "file is a few levels deep)") from None


def write_kv8_scales_json(path: str | os.PathLike[str], scales: KVScales, model: ModelScaleInfo,
                          key_offsets: KeyOffsets | None = None, key_scaling: KeyScaling | None = None) -> None:
    """Write ``scales`` (and ``key_offsets`` and ``key_scaling``, if any) in the kv8 schema::

        {"format": "kv8-kv-scales", "version": 1 | 2 | 3, "model_type": str, "num_layers": L, "num_kv_heads": H,
         "head_dim": D, "granularity": "tensor" | "head" | "channel", "made_for": fp8 format name | null,
         "rotation": "none" | "hadamard" | "none/hadamard" | "hadamard/none", "k": [[[float]]], "v": [[[float]]],
         "k_offset": [[[float]]],
         "k_channel_scale": [[[float]]]}

    ``rotation`` (absent means ``"none"``) names the basis the scales were calibrated in: a cache must use the
    same ``kv_cache_rotation``.

    ``k``/``v`` are nested lists of shape ``[L, 1, 1]``, ``[L, H, 1]`` or ``[L, H, D]`` (the KVScales shape).
    ``k_offset`` (version 2 only, :mod:`kv8.quant.key_offsets`) is ``[L, H, D]`` exactly: the mean every key of
    layer ``l`` and KV head ``h`` is centered by, post-RoPE and before the rotation; the scales then describe the
    centered keys. A file with it turns key centering on in every engine that loads it, whatever its cache format.
    ``k_channel_scale`` (version 3 only, :mod:`kv8.quant.key_scaling`; only beside ``k_offset``) is ``[L, H, D]``
    exactly, finite and > 0: the factor each centered key channel is multiplied by (and each query divided by)
    before the rotation; the scales ``k`` / ``v`` still describe the unscaled keys.
    """
    check_fits(scales, model)
    if key_offsets is not None:
        key_offsets.check_fits(model.num_layers, model.num_kv_heads, model.head_dim)
    if key_scaling is not None:
        if key_offsets is None:
            raise ValueError("k_channel_scale (key scaling) is written only beside k_offset (key centering)")
        key_scaling.check_fits(model.num_layers, model.num_kv_heads, model.head_dim)
    version = (KV8_SCALES_VERSION if key_offsets is None else
               KV8_OFFSETS_VERSION if key_scaling is None else KV8_KEY_SCALING_VERSION)
    doc = {
        "format": KV8_SCALES_FORMAT, "version": version,
        "model_type": model.model_type,
        "num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
        "granularity": scales.granularity.value, "made_for": scales.made_for, "rotation": scales.rotation,
        "k": scales.k.tolist(), "v": scales.v.tolist(),
    }
    if key_offsets is not None:
        doc["k_offset"] = key_offsets.k.tolist()
    if key_scaling is not None:
        doc["k_channel_scale"] = key_scaling.s.tolist()
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.write("\n")


def _check_version(data: dict[str, Any], where: str) -> None:
    version = data.get("version")
    if version not in KV8_SCALES_VERSIONS or isinstance(version, bool):
        raise ValueError(f"{where}: kv8 scales file version is {version!r}; kv8 reads versions "
                         f"{', '.join(map(str, KV8_SCALES_VERSIONS))}")
    if "k_offset" in data and version not in (KV8_OFFSETS_VERSION, KV8_KEY_SCALING_VERSION):
        raise ValueError(f"{where}: 'k_offset' (key centering) needs version {KV8_OFFSETS_VERSION} or "
                         f"{KV8_KEY_SCALING_VERSION}, but the file says version {version!r}")
    if "k_channel_scale" in data and version != KV8_KEY_SCALING_VERSION:
        raise ValueError(f"{where}: 'k_channel_scale' (key scaling) needs version {KV8_KEY_SCALING_VERSION}, but "
                         f"the file says version {version!r}")
    if "k_channel_scale" in data and "k_offset" not in data:
        raise ValueError(f"{where}: 'k_channel_scale' (key scaling) comes only beside 'k_offset' (key centering); "
                         "the file has no k_offset")


def _nested_floats(raw: Any, name: str, where: str) -> torch.Tensor:
    """A JSON ``[layers][heads][channels]`` list of numbers as a float32 tensor; ValueError naming ``name``."""
    ok = isinstance(raw, list) and all(
        isinstance(h, list) and all(isinstance(c, list) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in c) for c in h) for h in raw)
    if not ok:
        raise ValueError(f"{where}: '{name}' must be a nested list of numbers [layers][heads][channels]")
    try:
        return torch.tensor(raw, dtype=torch.float32)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: '{name}' is not a rectangular [layers][heads][channels] list: {e}") from None


def _kv8_scales_from_doc(data: dict[str, Any], where: str, model: ModelScaleInfo) -> KVScales:
    _check_version(data, where)
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
    tensors = {name: _nested_floats(data.get(name), name, where) for name in ("k", "v")}
    try:
        scales = KVScales(k=tensors["k"], v=tensors["v"], granularity=granularity,
                          source=f"quantization_param_path {where}", made_for=data.get("made_for"),
                          rotation=data.get("rotation", "none"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    check_fits(scales, model)
    if "k_offset" in data:
        _offsets_from_doc(data, where, model)   # a file is valid as a whole or not at all
    if "k_channel_scale" in data:
        _key_scaling_from_doc(data, where, model)
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


def _per_channel_from_doc(data: dict[str, Any], field: str, cls: type[_PerChannel], where: str,
                          model: ModelScaleInfo) -> _PerChannel:
    """The file's ``[L, H, D]`` field ``field`` (``k_offset`` or ``k_channel_scale``) as ``cls``, validated by it and
    against ``model``; every error names the file."""
    t = _nested_floats(data[field], field, where)
    try:
        value = cls(t, f"quantization_param_path {where}")
        value.check_fits(model.num_layers, model.num_kv_heads, model.head_dim)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return value


def _offsets_from_doc(data: dict[str, Any], where: str, model: ModelScaleInfo) -> KeyOffsets:
    return _per_channel_from_doc(data, "k_offset", KeyOffsets, where, model)


def _key_scaling_from_doc(data: dict[str, Any], where: str, model: ModelScaleInfo) -> KeyScaling:
    return _per_channel_from_doc(data, "k_channel_scale", KeyScaling, where, model)


def _kv8_doc_with(path: str | os.PathLike[str], field: str) -> dict[str, Any] | None:
    """The JSON of ``path`` when it is a kv8 scales file with ``field``, else None (a vLLM file never has one).
    ValueError for an unreadable file."""
    data = _read_json(path)
    return data if isinstance(data, dict) and data.get("format") == KV8_SCALES_FORMAT and field in data else None


def file_has_key_offsets(path: str | os.PathLike[str]) -> bool:
    """Whether a ``quantization_param_path`` file carries key offsets (a kv8 file with ``"k_offset"``; nothing
    else is validated here: :func:`load_key_offsets` does that against the model). ValueError for an unreadable
    file."""
    return _kv8_doc_with(path, "k_offset") is not None


def file_has_key_scaling(path: str | os.PathLike[str]) -> bool:
    """Whether a ``quantization_param_path`` file carries key scaling's factors (a kv8 file with
    ``"k_channel_scale"``; validated by :func:`load_key_scaling`). ValueError for an unreadable file."""
    return _kv8_doc_with(path, "k_channel_scale") is not None


def load_key_offsets(path: str | os.PathLike[str], model: ModelScaleInfo) -> KeyOffsets | None:
    """The key offsets of a ``quantization_param_path`` file for ``model`` (the whole model, every KV head; an
    engine cuts them to its rank's heads), or None when it has none (a vLLM file never has). The file is
    validated as :func:`load_kv8_scales_json` does; ``k_offset`` must be ``[num_layers, num_kv_heads, head_dim]``
    of finite numbers."""
    data = _kv8_doc_with(path, "k_offset")
    if data is None:
        return None
    where = os.fspath(path)
    _kv8_scales_from_doc(data, where, model)   # the whole file is checked, scales included
    return _offsets_from_doc(data, where, model)


def load_key_scaling(path: str | os.PathLike[str], model: ModelScaleInfo) -> KeyScaling | None:
    """The key factors of a ``quantization_param_path`` file for ``model`` (every KV head), or None when it has
    none. The file is validated as :func:`load_kv8_scales_json` does; ``k_channel_scale`` must be
    ``[num_layers, num_kv_heads, head_dim]`` of finite numbers > 0, beside ``k_offset``."""
    data = _kv8_doc_with(path, "k_channel_scale")
    if data is None:
        return None
    where = os.fspath(path)
    _kv8_scales_from_doc(data, where, model)   # the whole file is checked
    return _key_scaling_from_doc(data, where, model)


def load_scales_file(path: str | os.PathLike[str], model: ModelScaleInfo, tp_rank: int = 0,
                     tp_size: int = 1) -> KVScales:
    """Load a ``quantization_param_path``: a kv8 scales file (``"format": "kv8-kv-scales"``) or else a
    vLLM ``kv_cache_scales.json``, decided by the file's content. A vLLM file gives tensor-parallel rank
    ``tp_rank`` its own per-layer scales (``scaling_factor[tp_rank]``; the file must hold ``tp_size`` ranks); a
    kv8 file covers the whole model, for every rank (the caller keeps the rank's heads)."""
    data = _read_json(path)
    if isinstance(data, dict) and data.get("format") == KV8_SCALES_FORMAT:
        return _kv8_scales_from_doc(data, os.fspath(path), model)
    return load_vllm_scales_json(path, model, tp_rank, tp_size)
