"""Statistics of the K and V values an engine stores, and the fp8 scales they imply.

:class:`KVStatsCollector` accumulates, per layer and for K and V separately, the exact absolute maximum of
every (KV head, channel) and -- for the percentile and MSE statistics -- a histogram of ``|x|`` per scale
group (one group per layer for tensor granularity, per KV head for head granularity, per channel for channel
granularity). Histogram bins are log-spaced, ``BINS_PER_OCTAVE`` per power of two over
``[2^LOG2_LO, 2^LOG2_HI)``, plus an underflow bin (``|x| < 2^LOG2_LO``, zeros included) and an overflow bin.

What is observed for K (``ScaleRecipe.key_bound``):

* ``"position"`` (default): the *position-invariant envelope* of each key. RoPE rotates every channel pair
  ``(j, j + D/2)`` (Llama's rotate-half layout) by an angle that depends on the position, so a post-RoPE key
  channel can reach the pair's norm ``r_j = sqrt(k_j^2 + k_{j+D/2}^2)`` at *some* position even if calibration
  never saw that position -- the reason plain amax scales clip at unseen positions. The envelope replaces
  channel ``i`` by ``sup over positions |k_i|``: ``r`` of its pair without a K/V rotation, and
  ``sum_j r_j * sqrt(R[j, i]^2 + R[j + D/2, i]^2)`` when keys are stored rotated by an orthonormal ``R``
  (``kv8.quant.rotation``; the pair norms are taken of the un-rotated key). Every statistic below is then
  computed over envelopes, so the scales hold for the same keys at any position.
* ``"observed"``: the stored values themselves (what vLLM-style calibration measures).

With key centering (``kv8 calibrate --key-centering``, :mod:`kv8.quant.key_offsets`) the cache stores
``(k - c) R``; :class:`KeyMeanCollector` measures ``c`` (the mean post-RoPE key per layer, KV head and channel, in
a first pass), and the collector is given ``c R`` (``key_offset``) and records the centered keys: observed,
``k R - c R``; with the position bound, the envelope of the uncentered key plus ``|c R|`` -- a channel of ``k``
ranges over ``[-r, r]`` with the position, so ``sup |k_i - c_i| = r + |c_i|`` (without a rotation; with one, a
bound by the triangle inequality). A bound that holds at every position is looser for centered keys than for
uncentered ones, so static FP8 scales gain less from centering than per-token scales do.

V is always observed as stored (it carries no position), so nothing bounds it on text calibration never saw:
its scales get an extra ``ScaleRecipe.v_headroom`` (default 2, one power of two; the held-out check of
``kv8 calibrate --check-samples`` found SmolLM2's values up to 1.3-1.6x beyond their calibrated maxima).

Statistics per group (the scale is then ``statistic * headroom / format max``, times ``v_headroom`` for V,
rounded *up* to a power of two when ``ScaleRecipe.power_of_two``, the default):

* ``amax``: the exact maximum of ``|x|``;
* ``percentile``: the upper edge of the bin holding the ``ceil(p/100 * N)``-th smallest ``|x|``, capped at
  amax, so ``true percentile <= statistic <= true percentile * 2^(1/BINS_PER_OCTAVE)``;
* ``mse``: the clip value ``f * amax``, ``f`` among ``MSE_CANDIDATES`` factors from 1 down to 1/8 (with
  power-of-two scales: the clip values of the first power-of-two scale at or above amax's and of its halves
  down to 1/8), that minimises the squared fp8 round-trip error of the histogram (each bin represented by its
  geometric centre, the underflow bin by 0, the overflow bin by amax); ties go to the larger clip value.

A group that only ever held zeros has statistic 0; any scale stores it exactly, and it gets scale 1.0.

Why powers of two: for a scale ``s = 2^-k <= 1`` the values ``s * fp8`` include every fp8 value up to
``s * max`` (the fp8 grid only gets finer), so round-to-nearest of any ``|x| <= s * max`` is at least as close
as at scale 1.0, value by value: such a scale can only remove subnormal rounding error, never add error except
by clipping. A non-power-of-two scale moves every rounding boundary and can be worse than 1.0 on any value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kv8.quant.formats import FP8Format
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling, key_scales_from_moments
from kv8.quant.scales import KVScales, ScaleGranularity
from kv8.validators import check_number

LOG2_LO, LOG2_HI, BINS_PER_OCTAVE = -24, 24, 32
NUM_BINS = (LOG2_HI - LOG2_LO) * BINS_PER_OCTAVE + 2
MSE_CANDIDATES = 97
STATISTICS = ("amax", "percentile", "mse")
KEY_BOUNDS = ("position", "observed")


def check_key_bound(key_bound: str) -> None:
    """Raise ValueError unless ``key_bound`` is one of :data:`KEY_BOUNDS`."""
    if key_bound not in KEY_BOUNDS:
        raise ValueError(f"key_bound={key_bound!r} is not known; choose one of: {', '.join(KEY_BOUNDS)}")


@dataclass(frozen=True)
class ScaleRecipe:
    """How observed statistics become scales. ``percentile`` is only used by the percentile statistic."""

    granularity: ScaleGranularity
    statistic: str
    fmt: FP8Format
    percentile: float = 99.99
    headroom: float = 1.0
    v_headroom: float = 2.0
    key_bound: str = "position"
    power_of_two: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.granularity, ScaleGranularity):
            raise ValueError(f"granularity={self.granularity!r} must be one of {[g.value for g in ScaleGranularity]}")
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic={self.statistic!r} is not known; choose one of: {', '.join(STATISTICS)}")
        if not isinstance(self.fmt, FP8Format):
            raise ValueError(f"fmt={self.fmt!r} must be an FP8Format")
        check_number("percentile", self.percentile, 0, 100, exclusive_minimum=True)
        for name in ("headroom", "v_headroom"):   # 1.0 = none
            check_number(name, getattr(self, name), 0, exclusive_minimum=True)
        check_key_bound(self.key_bound)
        if not isinstance(self.power_of_two, bool):
            raise ValueError(f"power_of_two={self.power_of_two!r} must be a bool")

    @property
    def needs_histogram(self) -> bool:
        return self.statistic != "amax"


def key_envelope(key: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """Position-invariant envelope (float32, same shape) of stored keys ``[..., D]``; see the module docstring.
    ``rotation`` is the orthonormal ``R`` the stored keys were multiplied by (``k R``), or None."""
    k = key.float()
    d = k.shape[-1]
    if d % 2:
        raise ValueError(f"a RoPE key envelope needs an even head_dim, got {d}")
    half = d // 2
    if rotation is None:
        r = torch.sqrt(k[..., :half] ** 2 + k[..., half:] ** 2)
        return torch.cat((r, r), dim=-1)
    rot = rotation.float()
    k = k @ rot.T                                                     # back to the un-rotated (RoPE) basis
    r = torch.sqrt(k[..., :half] ** 2 + k[..., half:] ** 2)          # [..., D/2], invariant under RoPE
    weight = torch.sqrt(rot[:half] ** 2 + rot[half:] ** 2)           # [D/2, D]
    return r @ weight


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= scale`` (elementwise, for positive finite scales)."""
    exp = torch.ceil(torch.log2(scale.double()))
    out = torch.exp2(exp)
    out = torch.where(out < scale.double(), out * 2, out)             # guard log2 rounding
    return out.to(scale.dtype)


def _bin_index(x: torch.Tensor) -> torch.Tensor:
    """Histogram bin of each ``|x|`` (int64, same shape)."""
    idx = torch.floor((torch.log2(x.abs()) - LOG2_LO) * BINS_PER_OCTAVE) + 1
    return idx.nan_to_num(0.0, posinf=NUM_BINS - 1, neginf=0.0).clamp(0, NUM_BINS - 1).long()


def _bin_upper_edges() -> torch.Tensor:
    """[NUM_BINS] float64 upper edge of each bin (the overflow bin's is +inf)."""
    b = torch.arange(NUM_BINS, dtype=torch.float64)
    edges = torch.exp2(LOG2_LO + b / BINS_PER_OCTAVE)
    edges[-1] = math.inf
    return edges


def _bin_centres() -> torch.Tensor:
    """[NUM_BINS] float64 representative value of each bin (underflow 0; overflow NaN, replaced by amax)."""
    b = torch.arange(NUM_BINS, dtype=torch.float64)
    centres = torch.exp2(LOG2_LO + (b - 0.5) / BINS_PER_OCTAVE)
    centres[0] = 0.0
    centres[-1] = math.nan
    return centres


class KVStatsCollector:
    """Accumulates K/V statistics per layer; see the module docstring. Tensors index ``[0]`` = K, ``[1]`` = V."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 histogram_granularity: ScaleGranularity | None, key_bound: str = "position",
                 rotation: torch.Tensor | None = None, key_offset: torch.Tensor | None = None) -> None:
        """``key_offset``: ``c R`` ``[L, H, D]`` float32, the key offsets in the stored basis; the keys shown to
        :meth:`observe` are uncentered (what a cache without centering stores) and are recorded centered."""
        check_key_bound(key_bound)
        if key_offset is not None and list(key_offset.shape) != [num_layers, num_kv_heads, head_dim]:
            raise ValueError(f"key_offset has shape {list(key_offset.shape)}, expected "
                             f"{[num_layers, num_kv_heads, head_dim]}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.key_bound, self.rotation = key_bound, rotation
        self.key_offset = None if key_offset is None else key_offset.float()
        self.amax = torch.zeros(2, num_layers, num_kv_heads, head_dim, dtype=torch.float32)
        self.num_tokens = torch.zeros(num_layers, dtype=torch.int64)
        self.histogram_granularity = histogram_granularity
        self.hist: torch.Tensor | None = None
        if histogram_granularity is not None:
            self.hist = torch.zeros(2, num_layers, self._num_groups(histogram_granularity), NUM_BINS,
                                    dtype=torch.int64)

    def _num_groups(self, g: ScaleGranularity) -> int:
        return {ScaleGranularity.TENSOR: 1, ScaleGranularity.HEAD: self.num_kv_heads,
                ScaleGranularity.CHANNEL: self.num_kv_heads * self.head_dim}[g]

    def _group_of(self) -> torch.Tensor:
        """[H, D] group index of each (head, channel) for the histogram granularity."""
        h, d = self.num_kv_heads, self.head_dim
        g = self.histogram_granularity
        if g is ScaleGranularity.TENSOR:
            return torch.zeros(h, d, dtype=torch.int64)
        if g is ScaleGranularity.HEAD:
            return torch.arange(h).unsqueeze(1).expand(h, d)
        return torch.arange(h * d).reshape(h, d)

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Record new tokens of ``layer``: key/value ``[T, H, D]`` (what the cache is asked to store).
        With ``key_bound="position"`` the key's envelope is recorded instead of the key."""
        self.num_tokens[layer] += key.shape[0]
        groups = self._group_of() if self.hist is not None else None
        if self.key_bound == "position":
            key = key_envelope(key.detach(), self.rotation)
            if self.key_offset is not None:
                key = key + self.key_offset[layer].abs()
        elif self.key_offset is not None:
            key = key.detach().float() - self.key_offset[layer]
        for i, x in enumerate((key, value)):
            xf = x.detach().float()
            if xf.shape[0] == 0:
                continue
            torch.maximum(self.amax[i, layer], xf.abs().amax(dim=0), out=self.amax[i, layer])
            if self.hist is not None and groups is not None:
                flat = (groups.unsqueeze(0) * NUM_BINS + _bin_index(xf)).reshape(-1)
                self.hist[i, layer] += torch.bincount(flat, minlength=self.hist.shape[2] * NUM_BINS).view(
                    self.hist.shape[2], NUM_BINS)

    def heads(self, first: int, count: int) -> KVStatsCollector:
        """The statistics of KV heads ``first .. first + count - 1`` pooled into one group per layer: a collector
        for tensor-granularity scales over those heads only (what one tensor-parallel rank holds). Exact for
        every statistic: the maxima are sliced and, when this collector keeps per-head histograms, the heads'
        histograms are summed (with tensor histograms, or none, only ``amax`` can be pooled this way)."""
        if not (0 <= first and count >= 1 and first + count <= self.num_kv_heads):
            raise ValueError(f"KV heads {first}..{first + count - 1} are not within the {self.num_kv_heads} heads")
        g = self.histogram_granularity
        if g is ScaleGranularity.CHANNEL:
            raise ValueError("pooling heads needs head or tensor histograms, not channel ones")
        if g is ScaleGranularity.TENSOR and count != self.num_kv_heads:
            raise ValueError("a tensor-granularity histogram cannot be cut to some heads; collect head histograms")
        offset = None if self.key_offset is None else self.key_offset[:, first:first + count]
        sub = KVStatsCollector(self.num_layers, count, self.head_dim, None, self.key_bound, self.rotation, offset)
        sub.amax = self.amax[:, :, first:first + count].clone()
        sub.num_tokens = self.num_tokens.clone()
        if self.hist is not None:
            sub.histogram_granularity = ScaleGranularity.TENSOR
            sub.hist = self.hist[:, :, first:first + count].sum(dim=2, keepdim=True) if g is ScaleGranularity.HEAD \
                else self.hist.clone()
        return sub

    def amax_at(self, granularity: ScaleGranularity) -> torch.Tensor:
        """[2, L, H or 1, D or 1] exact absolute maxima reduced to ``granularity``."""
        if granularity is ScaleGranularity.TENSOR:
            return self.amax.amax(dim=(2, 3), keepdim=True)
        if granularity is ScaleGranularity.HEAD:
            return self.amax.amax(dim=3, keepdim=True)
        return self.amax.clone()

    def _grouped(self, t: torch.Tensor, granularity: ScaleGranularity) -> torch.Tensor:
        """[2, L, H', D'] -> [2, L, G] in histogram-group order."""
        return t.reshape(2, self.num_layers, self._num_groups(granularity))

    def statistic(self, recipe: ScaleRecipe) -> torch.Tensor:
        """[2, L, H or 1, D or 1] float32 statistic per scale group (before headroom and format max)."""
        if int(self.num_tokens.min()) == 0:
            raise ValueError("no K/V values were observed for some layer; calibration needs at least one token")
        amax = self.amax_at(recipe.granularity)
        if recipe.statistic == "amax":
            return amax
        if self.hist is None or self.histogram_granularity is not recipe.granularity:
            raise ValueError(f"statistic {recipe.statistic!r} at {recipe.granularity.value} granularity needs a "
                             f"histogram collected at that granularity")
        group_amax = self._grouped(amax, recipe.granularity).double()
        if recipe.statistic == "percentile":
            stat = self._percentile(recipe.percentile, group_amax)
        else:
            stat = self._mse_clip(recipe.fmt, group_amax, recipe.power_of_two)
        return stat.float().reshape(amax.shape)

    def _percentile(self, q: float, group_amax: torch.Tensor) -> torch.Tensor:
        assert self.hist is not None
        counts = self.hist.double()
        total = counts.sum(-1, keepdim=True)
        rank = torch.ceil(total * (q / 100.0)).clamp(min=1)
        first = (counts.cumsum(-1) >= rank).double().argmax(-1)          # first bin reaching the rank
        return torch.minimum(_bin_upper_edges()[first], group_amax)

    def _mse_clip(self, fmt: FP8Format, group_amax: torch.Tensor, power_of_two: bool) -> torch.Tensor:
        assert self.hist is not None
        counts = self.hist.double()                                       # [2, L, G, B]
        values = _bin_centres().expand_as(counts).clone()
        values[..., -1] = group_amax
        values = torch.minimum(values, group_amax.unsqueeze(-1))
        top = group_amax
        if power_of_two:  # candidates are the clip values of power-of-two scales: 1, 1/2, 1/4, 1/8 of the first
            top = torch.where(group_amax > 0, round_up_pow2(group_amax / fmt.max_finite) * fmt.max_finite,
                              group_amax)
            factors = torch.exp2(-torch.arange(4, dtype=torch.float64))
        else:
            factors = torch.exp2(torch.linspace(0.0, -3.0, MSE_CANDIDATES, dtype=torch.float64))
        best_err = torch.full_like(group_amax, math.inf)
        best = group_amax.clone()
        for f in factors.tolist():
            clip = top * f
            scale = torch.where(clip > 0, clip / fmt.max_finite, torch.ones_like(clip)).unsqueeze(-1)
            x = (values / scale).float()
            err = ((fmt.decode(fmt.encode(x)).double() * scale - values) ** 2 * counts).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, clip, best)
        return best

    def scales(self, recipe: ScaleRecipe, source: str, rotation: str = "none") -> KVScales:
        """:class:`KVScales` made for ``recipe.fmt``: ``statistic * headroom / fmt.max_finite`` per group (times
        ``v_headroom`` for V), rounded up to a power of two if ``recipe.power_of_two``. ``rotation`` names the
        basis of the K/V."""
        if recipe.key_bound != self.key_bound:
            raise ValueError(f"the recipe's key_bound={recipe.key_bound!r} but this collector recorded "
                             f"key_bound={self.key_bound!r}")
        stat = self.statistic(recipe) * recipe.headroom
        stat[1] = stat[1] * recipe.v_headroom
        scale = torch.where(stat > 0, stat / recipe.fmt.max_finite, torch.ones_like(stat))
        if recipe.power_of_two:
            scale = round_up_pow2(scale)
        return KVScales(k=scale[0], v=scale[1], granularity=recipe.granularity, source=source,
                        made_for=recipe.fmt.name, rotation=rotation)


class KeyMeanCollector:
    """The mean key per (layer, KV head, channel) of every key observed (float64 sums): the offsets of key
    centering; with ``queries=True`` also the mean squared key and the mean squared query per (layer, KV head,
    channel), the queries of each KV head's group pooled: what key scaling's factors are computed from
    (:func:`kv8.quant.key_scaling.key_scales_from_moments`). Keys and queries are shown in the model's basis
    (post-RoPE, before any rotation: :meth:`kv8.observer.EngineObserver.on_attention_inputs`)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, queries: bool = False) -> None:
        self.sum = torch.zeros(num_layers, num_kv_heads, head_dim, dtype=torch.float64)
        self.num_tokens = torch.zeros(num_layers, dtype=torch.int64)
        self.sum_sq: torch.Tensor | None = None
        self.query_sum_sq: torch.Tensor | None = None
        self.num_queries = torch.zeros(num_layers, dtype=torch.int64)
        if queries:
            self.sum_sq = torch.zeros_like(self.sum)
            self.query_sum_sq = torch.zeros_like(self.sum)

    def observe(self, layer: int, key: torch.Tensor, query: torch.Tensor | None = None) -> None:
        """Record new keys ``[T, H, D]`` of ``layer`` (and, when collecting them, its queries ``[T, Hq, D]``, each
        KV head's ``Hq / H`` query heads consecutive)."""
        k = key.detach().double()
        self.sum[layer] += k.sum(dim=0)
        self.num_tokens[layer] += key.shape[0]
        if self.sum_sq is not None and self.query_sum_sq is not None:
            self.sum_sq[layer] += k.pow(2).sum(dim=0)
            if query is None:
                raise ValueError("this collector measures queries too: observe(layer, key, query)")
            t, hq, d = query.shape
            h = key.shape[1]
            q = query.detach().double().view(t, h, hq // h, d)
            self.query_sum_sq[layer] += q.pow(2).sum(dim=(0, 2))
            self.num_queries[layer] += t * (hq // h)

    def offsets(self, source: str) -> KeyOffsets:
        """The means as :class:`KeyOffsets`; ValueError when some layer saw no key."""
        if int(self.num_tokens.min()) == 0:
            raise ValueError("no keys were observed for some layer; key centering needs at least one token")
        return KeyOffsets((self.sum / self.num_tokens.view(-1, 1, 1).double()).float(), source)

    def scaling(self, source: str) -> KeyScaling:
        """Key scaling's factors for the centered keys: ``(E[q^2] / E[(k - mean)^2]) ^ (1/4)`` per (layer, KV head,
        channel), normalised per head (:func:`kv8.quant.key_scaling.key_scales_from_moments`). ValueError without
        query statistics or when some layer saw no key."""
        if self.sum_sq is None or self.query_sum_sq is None:
            raise ValueError("key scaling needs query statistics: KeyMeanCollector(..., queries=True)")
        if int(self.num_tokens.min()) == 0 or int(self.num_queries.min()) == 0:
            raise ValueError("no keys were observed for some layer; key scaling needs at least one token")
        n = self.num_tokens.view(-1, 1, 1).double()
        mean = self.sum / n
        key_sq = (self.sum_sq / n - mean.pow(2)).clamp_min(0)          # E[(k - c)^2]
        query_sq = self.query_sum_sq / self.num_queries.view(-1, 1, 1).double()
        return KeyScaling(key_scales_from_moments(query_sq, key_sq), source)


class ClipCounter:
    """Counts, per layer, how many K and V values would clip with given scales: ``|x| > scale * fmt max``
    (values exactly at the limit are representable), and the largest ``|x| / (scale * fmt max)`` seen.
    It has the collector interface: ``observe(layer, key, value)``; with ``key_offset`` (``c R``, as for
    :class:`KVStatsCollector`) the keys it is shown are centered first."""

    def __init__(self, scales: KVScales, fmt: FP8Format, key_offset: torch.Tensor | None = None) -> None:
        self.key_offset = None if key_offset is None else key_offset.float()
        self.limits = [scales.k.float() * fmt.max_finite, scales.v.float() * fmt.max_finite]  # [L, H|1, D|1]
        num_layers = scales.k.shape[0]
        self.clipped = torch.zeros(2, num_layers, dtype=torch.int64)
        self.total = torch.zeros(2, num_layers, dtype=torch.int64)
        self.worst = torch.zeros(2, num_layers, dtype=torch.float64)

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.key_offset is not None:
            key = key.detach().float() - self.key_offset[layer]
        for i, x in enumerate((key, value)):
            ratio = x.detach().float().abs() / self.limits[i][layer]
            self.clipped[i, layer] += int((ratio > 1.0).sum())
            self.total[i, layer] += ratio.numel()
            if ratio.numel():
                self.worst[i, layer] = max(float(self.worst[i, layer]), float(ratio.max()))
