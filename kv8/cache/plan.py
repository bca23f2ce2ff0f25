"""Each layer's KV storage: :class:`KVSpec` (format, rotation, scales), :class:`KVPlan` (a spec per layer) and the
``kv_cache_plan`` file that sets them (:func:`read_plan_file`).

A plan lists the distinct specs once and maps every model layer to one of them::

    specs       (fp8_e4m3, none, static)   (bfloat16, none)   (int4_per_token_head, hadamard)
    layer_spec   0  1  1  0  2  0 ...      model layer -> index into specs

``specs[0]`` is always the cache's own spec (``kv_cache_dtype``, ``kv_cache_rotation``, ``kv_cache_scale_mode``),
used or not; the others follow in the order of the first layer that uses them, so the order is deterministic.
Layers of one spec share a pool (:class:`kv8.cache.layout.KVCacheLayout`), whose codec the worker builds from the
spec. ``kv_cache_dtype_skip_layers`` is one way to set a plan: its layers get the compute dtype, no rotation;
``kv_cache_plan`` is the other: a JSON file (what ``kv8 calibrate --plan`` is to write)::

    {"kv8_kv_plan": 1,
     "layers": {"0": {"kv_cache_dtype": "bfloat16"},
                "5": {"kv_cache_dtype": "int4_per_token_head", "kv_cache_rotation": "hadamard"},
                "6": {"kv_cache_dtype": "int8_per_token_head/int4_per_group32"},
                "7": {"kv_cache_dtype": "fp8_e4m3/int4_per_group32", "kv_cache_rotation": "none/hadamard"}}}

(a ``kv_cache_dtype`` of a layer may be a K/V pair, as the option's may: keys in one format, values in another; so
may its ``kv_cache_rotation``: keys as they are, values rotated)

An optional ``"calibration"`` object records how the plan was made (``kv8 calibrate --plan`` writes the budget and
the predicted and measured KLD there); the engine reads nothing from it. A layer the file does not name, and a key
a layer's entry leaves out, take the option's value (``kv_cache_dtype``,
``kv_cache_rotation``). ``kv_cache_scale_mode`` applies to every FP8 layer (static: the layers share the per-layer
scales of ``quantization_param_path`` or the checkpoint; dynamic: every FP8 layer keeps a scale per token and
head); the int formats always keep theirs. The file is read and its names checked once, by
:class:`kv8.cache.config.CacheConfig`; the layer indices and rotations against the model by
:class:`kv8.engine.config.EngineConfig`.

Invariants: ``len(layer_spec)`` is the model's layer count; the specs are distinct; every ``layer_spec[i]`` indexes
``specs``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kv8.cache.codec import KVCodec
from kv8.quant.formats import KVCacheDtype, check_kv_cache_dtype, kv_cache_dtype_name
from kv8.quant.rotation import canonical_rotation, is_rotated

__all__ = ["PLAN_VERSION", "KVPlan", "KVPlanEntry", "KVPlanFile", "KVSpec", "read_plan_file"]

#: the ``kv8_kv_plan`` version this kv8 reads and writes
PLAN_VERSION = 1
_ENTRY_KEYS = ("kv_cache_dtype", "kv_cache_rotation")


@dataclass(frozen=True)
class KVSpec:
    """How one layer's K/V are stored: the format (the keys', and the values' unless ``v_dtype`` names theirs: a K/V
    pair), the basis, and whether tokens keep their own scales (``dynamic``: FP8 with
    ``kv_cache_scale_mode="dynamic"``, the int formats always; in a pair, its FP8 and int sides always). Build with
    :meth:`of`, which keeps ``v_dtype`` None unless the two formats differ (so one format has one spec)."""

    kv_dtype: KVCacheDtype
    rotation: str = "none"
    dynamic: bool = False
    v_dtype: KVCacheDtype | None = None

    @staticmethod
    def of(kv_dtype: KVCacheDtype, rotation: str = "none", scale_mode: str = "static",
           v_dtype: KVCacheDtype | None = None) -> KVSpec:
        """The spec of a format (or of keys in ``kv_dtype`` beside values in ``v_dtype``) with a rotation and
        ``kv_cache_scale_mode`` (it applies to the FP8 format of one-format specs only)."""
        rotation = canonical_rotation(rotation)
        if v_dtype is None or v_dtype == kv_dtype:
            return KVSpec(kv_dtype, rotation,
                          kv_dtype.per_token_scales or (kv_dtype.is_fp8 and scale_mode == "dynamic"))
        return KVSpec(kv_dtype, rotation, kv_dtype.token_scalable or v_dtype.token_scalable, v_dtype)

    @property
    def values_dtype(self) -> KVCacheDtype:
        """The values' format (:attr:`kv_dtype` unless the spec is a K/V pair)."""
        return self.kv_dtype if self.v_dtype is None else self.v_dtype

    @property
    def name(self) -> str:
        """The format's canonical name, ``"K/V"`` for a pair (what ``kv_cache_dtype`` accepts)."""
        return kv_cache_dtype_name(self.kv_dtype, self.values_dtype)

    @property
    def static_fp8(self) -> bool:
        """An FP8 format with static per-layer scales (the file's, the checkpoint's or 1.0)."""
        return self.kv_dtype.is_fp8 and not self.dynamic

    def token_bytes(self, head_dim: int, kv_heads: int) -> int:
        """Bytes one token of one layer takes: K and V of ``kv_heads`` heads, codes and per-token scales."""
        return kv_heads * sum(KVCodec.bytes_per_head(d, head_dim, self.dynamic)
                              for d in (self.kv_dtype, self.values_dtype))

    def describe(self) -> str:
        """``fp8_e4m3 + hadamard, dynamic scales``: the format, then what differs from the plain format."""
        parts = [self.name + (f" + {self.rotation}" if is_rotated(self.rotation) else "")]
        if self.dynamic and not self.kv_dtype.per_token_scales and self.v_dtype is None:
            parts.append("dynamic scales")
        return ", ".join(parts)


@dataclass(frozen=True)
class KVPlan:
    """A :class:`KVSpec` per model layer: ``specs[layer_spec[i]]`` stores layer ``i`` (see the module docstring)."""

    specs: tuple[KVSpec, ...]
    layer_spec: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layer_spec or len(set(self.specs)) != len(self.specs) or not all(
                0 <= s < len(self.specs) for s in self.layer_spec):
            raise ValueError(f"a KV plan needs distinct specs and a spec index per layer: {self}")

    @staticmethod
    def build(default: KVSpec, num_layers: int, overrides: Mapping[int, KVSpec] | None = None) -> KVPlan:
        """Every layer in ``default`` except those ``overrides`` names (layer -> spec; indices < ``num_layers``)."""
        overrides = overrides or {}
        specs = [default]
        layer_spec = []
        for layer in range(num_layers):
            spec = overrides.get(layer, default)
            if spec not in specs:
                specs.append(spec)
            layer_spec.append(specs.index(spec))
        return KVPlan(tuple(specs), tuple(layer_spec))

    @property
    def num_layers(self) -> int:
        return len(self.layer_spec)

    def layers_of(self, spec: int) -> tuple[int, ...]:
        """The layers stored in ``specs[spec]``, ascending."""
        return tuple(i for i, s in enumerate(self.layer_spec) if s == spec)

    def used(self) -> tuple[KVSpec, ...]:
        """The specs at least one layer uses, in ``specs`` order."""
        return tuple(s for i, s in enumerate(self.specs) if i in self.layer_spec)


@dataclass(frozen=True)
class KVPlanEntry:
    """One layer of a plan file as written: the names (checked), None where the entry leaves the key out."""

    layer: int
    kv_cache_dtype: str | None = None
    kv_cache_rotation: str | None = None


@dataclass(frozen=True)
class KVPlanFile:
    """A ``kv_cache_plan`` file, read and its names checked (:func:`read_plan_file`); entries by ascending layer."""

    path: str
    entries: tuple[KVPlanEntry, ...]

    def kv_cache_dtypes(self) -> tuple[str, ...]:
        """The format names the entries give."""
        return tuple(e.kv_cache_dtype for e in self.entries if e.kv_cache_dtype is not None)


def read_plan_file(path: str | os.PathLike[str]) -> KVPlanFile:
    """Read a ``kv_cache_plan`` file. ``ValueError`` naming the file, the layer and the key, with what is allowed,
    for a missing file, one that is not JSON, another version, an unknown key, a layer that is not an index >= 0,
    an unknown format or rotation. (Indices beyond the model: :class:`kv8.engine.config.EngineConfig`.)"""
    where = f"kv_cache_plan={os.fspath(path)!r}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON: {e}") from None
    version = data.get("kv8_kv_plan") if isinstance(data, dict) else None
    if type(version) is not int or version != PLAN_VERSION:
        raise ValueError(f"{where}: kv8_kv_plan is {version!r}; this kv8 reads plan files of version {PLAN_VERSION} "
                         f'({{"kv8_kv_plan": {PLAN_VERSION}, "layers": {{"0": {{"kv_cache_dtype": ...}}}}}})')
    unknown = sorted(set(data) - {"kv8_kv_plan", "layers", "calibration"})
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: kv8_kv_plan, layers, calibration")
    if not isinstance(data.get("calibration", {}), dict):
        raise ValueError(f"{where}: calibration must be an object (what made the plan), not "
                         f"{data['calibration']!r}")
    layers = data.get("layers", {})
    if not isinstance(layers, dict):
        raise ValueError(f"{where}: layers must be an object of layer index -> settings, not {layers!r}")
    entries = []
    for key, settings in layers.items():
        if not (isinstance(key, str) and key.isdecimal() and key.isascii()):
            raise ValueError(f"{where}: layer {key!r} must be a layer index >= 0 (such as \"0\")")
        if not isinstance(settings, dict):
            raise ValueError(f"{where}: layer {key} must be an object with {' and/or '.join(_ENTRY_KEYS)}, not "
                             f"{settings!r}")
        bad = sorted(set(settings) - set(_ENTRY_KEYS))
        if bad:
            raise ValueError(f"{where}: layer {key} has unknown keys {bad}; allowed: {', '.join(_ENTRY_KEYS)}")
        dtype, rotation = settings.get("kv_cache_dtype"), settings.get("kv_cache_rotation")
        if dtype is not None:
            try:
                check_kv_cache_dtype(dtype)
            except ValueError as e:
                raise ValueError(f"{where}: layer {key}: {e}") from None
        if rotation is not None:
            try:
                rotation = canonical_rotation(rotation)
            except ValueError as e:
                raise ValueError(f"{where}: layer {key}: {e}") from None
        entries.append(KVPlanEntry(int(key), dtype, rotation))
    if len({e.layer for e in entries}) != len(entries):
        raise ValueError(f"{where} names a layer twice (e.g. \"1\" and \"01\")")
    return KVPlanFile(os.fspath(path), tuple(sorted(entries, key=lambda e: e.layer)))
