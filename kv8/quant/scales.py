"""KV-cache scaling factors: the :class:`KVScales` object, its granularity and the model facts it must fit.

An fp8 KV cache stores ``saturate(rne(x / scale))`` and reads back ``stored * scale``. One scale per
layer (or per layer and KV head, or per channel) for K and one for V. Where scales come from and which one
wins: :mod:`kv8.cache.scale_sources`; the file formats that carry them: :mod:`kv8.quant.scale_files`.

Scales are computed for a specific fp8 format. E4M3FNUZ (ROCm) has the same bit patterns as E4M3FN but
an exponent bias one higher, so every value is half as large: scales made for one are converted for the
other by a factor of 2 (:meth:`KVScales.for_format`), as vLLM and TGI do on ROCm.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from kv8.quant.formats import E4M3, E4M3FNUZ, E5M2, FP8Format
from kv8.quant.rotation import canonical_rotation

__all__ = ["FORMAT_TO_TORCH_DTYPE", "KVScales", "ModelScaleInfo", "ScaleGranularity", "TORCH_DTYPE_TO_FORMAT",
           "check_fits"]

# torch dtype names used by vLLM JSON files and HF configs -> kv8 fp8 format names.
TORCH_DTYPE_TO_FORMAT: dict[str, str] = {
    "float8_e4m3fn": E4M3.name,
    "float8_e4m3fnuz": E4M3FNUZ.name,
}
FORMAT_TO_TORCH_DTYPE: dict[str, str] = {v: k for k, v in TORCH_DTYPE_TO_FORMAT.items()}



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
    # kv_cache_rotation="hadamard" stores them, or a K/V pair such as "none/hadamard" (only kv8's JSON schema can
    # carry it); spelled canonically (kv8.quant.rotation.canonical_rotation).
    rotation: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rotation", canonical_rotation(self.rotation, "KVScales.rotation"))
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


def check_fits(scales: KVScales, model: ModelScaleInfo) -> None:
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
