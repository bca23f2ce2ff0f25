"""The Triton store and attention over caches whose K and V are stored in different formats (``fp8`` K's, ``v_fp8``
V's: :func:`kv8.kernels.triton.store.store_kv`, :func:`kv8.kernels.triton.attention.unified_attention`).

Each side is built with a single-format :class:`KVCodec` of its own (FP8 and per-token integer codes with dynamic
scales, group and 16/32-bit formats as they are) and written to a K or V cache of its own dtype and row width. The
store is checked bit for bit against each side's :meth:`KVCodec.encode`; the attention against a plain torch
reference over each side's :meth:`KVCodec.decode` (float32 softmax), with the caches and token scales poisoned
where no key was stored (the kernel reading a slot it must not turns its output into NaN). Without a CUDA device the
kernels run in Triton's interpreter (few, small shapes: the CI runs these on 2 cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kv8.kernels.triton.attention as triton_attention
import kv8.kernels.triton.store as triton_store
from kv8.attention.metadata import AttentionMetadata
from kv8.cache.codec import KVCodec
from kv8.kernels.triton.formats import SAME_AS_K, kernel_format
from kv8.platform import Platform
from kv8.quant.formats import INT8, resolve_kv_cache_dtype
from kv8.quant.int4_group import INT4_G32
from tests.helpers.triton import DEVICES, on_device

unified_attention = triton_attention.unified_attention
store_kv = triton_store.store_kv

K8V4 = ("int8_per_token_head", "int4_per_group32")
PAIRS = [K8V4, ("int8_per_token_head", "int4_per_token_head"), ("fp8_e4m3", "int4_per_group32"),
         ("bfloat16", "int8_per_token_head"), ("int4_per_group32", "int8_per_token_head"), ("fp8_e4m3", "fp4_e2m1")]
IDS = [f"{k}/{v}" for k, v in PAIRS]


def _codec(name: str, head_dim: int) -> KVCodec:
    """A single-format codec of one side: dynamic scales for FP8 and per-token integer codes, none otherwise."""
    kv = resolve_kv_cache_dtype(name, torch.float32)
    dynamic = kv.is_quantized and not kv.group_scales
    return KVCodec.build(kv, head_dim, scale_mode="dynamic" if dynamic else "static")


@dataclass
class Side:
    """One side (K or V) of a cache of two formats: its codec, cache ``[num_blocks, H, bs, W]`` and token scales
    ``[num_blocks, H, bs]`` (None for a group or 16/32-bit format)."""

    codec: KVCodec
    cache: torch.Tensor
    token_scales: torch.Tensor | None

    @property
    def codes(self) -> object:
        return self.codec.kv_dtype.codes

    @staticmethod
    def poisoned(name: str, num_blocks: int, heads: int, block_size: int, head_dim: int) -> Side:
        codec = _codec(name, head_dim)
        kv = codec.kv_dtype
        cache = torch.empty(num_blocks, heads, block_size, kv.stored_width(head_dim), dtype=kv.storage_dtype)
        if kv.group is not None:
            cache.fill_(0xFF)                              # codes -1 / -6 beside NaN float16 / E4M3 scales
        elif kv.int_codes is not None:
            cache.view(torch.uint8).fill_(0x80)            # never written; the NaN token scales poison
        elif kv.fp8 is not None:
            cache.fill_(kv.fp8.nan_code)
        else:
            cache.fill_(float("nan"))
        ts = (torch.full((num_blocks, heads, block_size), float("nan"))
              if codec.dynamic and not kv.group_scales else None)
        return Side(codec, cache, ts)

    def store(self, x: torch.Tensor, which: int, slots: torch.Tensor) -> None:
        """The reference store: ``x [T, H, D]`` encoded by the codec into ``slots``."""
        bs = self.cache.shape[2]
        stored, ts = self.codec.encode(x, 0, which)
        self.cache[slots // bs, :, slots % bs] = stored
        if self.token_scales is not None:
            assert ts is not None
            self.token_scales[slots // bs, :, slots % bs] = ts

    def read(self, table: list[int], num_tokens: int, which: int) -> torch.Tensor:
        """The first ``num_tokens`` keys of a sequence decoded, float32 ``[num_tokens, H, D]``."""
        idx = torch.tensor(table)
        h, w = self.cache.shape[1], self.cache.shape[3]
        rows = self.cache[idx].transpose(1, 2).reshape(-1, h, w)[:num_tokens]
        ts = None
        if self.token_scales is not None:
            ts = self.token_scales[idx].transpose(1, 2).reshape(-1, h)[:num_tokens]
        return self.codec.decode(rows, 0, which, torch.float32, ts)


# ---- the store ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_store_writes_each_side_as_its_codec(pair: tuple[str, str], device: str) -> None:
    """Each side's bytes and token scales equal its own codec's encode; a negative slot writes nothing; nothing
    outside the stored slots changes."""
    g = torch.Generator().manual_seed(1)
    heads, d, bs, num_blocks = 2, 64, 16, 3
    k, v = (Side.poisoned(n, num_blocks, heads, bs, d) for n in pair)
    key = torch.randn(6, heads, d, generator=g) * (1.0 + 3.0 * torch.rand(d, generator=g))
    key[1, 0, :5] = 0.0
    value = torch.randn(6, heads, d, generator=g)
    value[2, 1, 3] = 1e-3
    key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)     # the engine's K/V dtype
    slots = torch.tensor([3, 17, -1, 40, 0, 31])
    want_k, want_v = (Side(s.codec, s.cache.clone(), None if s.token_scales is None else s.token_scales.clone())
                      for s in (k, v))
    keep = slots >= 0
    want_k.store(key[keep].float(), 0, slots[keep])
    want_v.store(value[keep].float(), 1, slots[keep])
    k_cache, v_cache = k.cache.to(device), v.cache.to(device)
    k_ts = None if k.token_scales is None else k.token_scales.to(device)
    v_ts = None if v.token_scales is None else v.token_scales.to(device)
    store_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device), fp8=k.codes,  # type: ignore
             v_fp8=v.codes, k_token_scales=k_ts, v_token_scales=v_ts)  # type: ignore[arg-type]
    for got, want in ((k_cache, want_k.cache), (v_cache, want_v.cache)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    for got_ts, want_ts in ((k_ts, want_k.token_scales), (v_ts, want_v.token_scales)):
        assert (got_ts is None) == (want_ts is None)
        if got_ts is not None and want_ts is not None:
            torch.testing.assert_close(got_ts.cpu(), want_ts, rtol=0, atol=0, equal_nan=True)


def test_store_validation_names_the_side() -> None:
    """A pair's scales and cache shapes are checked per side; errors name the argument, its value and what is
    allowed."""
    key = torch.zeros(3, 2, 64)
    k_cache = torch.zeros(4, 2, 16, 64, dtype=torch.int8)
    v_cache = torch.zeros(4, 2, 16, 36, dtype=torch.uint8)
    ts = torch.ones(4, 2, 16)
    args: dict[str, Any] = dict(key=key, value=key.clone(), k_cache=k_cache, v_cache=v_cache,
                                slot_mapping=torch.arange(3), fp8=INT8, v_fp8=INT4_G32, k_token_scales=ts)
    store_kv(**on_device(args))   # valid as it is: each case below fails for its own reason
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(k_token_scales=None), r"k_token_scales=None, but K's int8 codes need a scale per token and head"),
        (dict(v_token_scales=ts), r"v_token_scales given, but V \(int4_g32\) keeps a scale per group in each row; "
                                  r"allowed: v_token_scales=None"),
        (dict(k_scale=torch.ones(1, 1), v_scale=torch.ones(1, 1)),
         r"k_scale, v_scale given for K int8 and V int4_g32; a cache of two formats takes no static scales"),
        (dict(v_cache=torch.zeros(4, 2, 16, 64, dtype=torch.uint8)),
         r"v_cache has shape \[4, 2, 16, 64\], must be \[num_blocks, H=2, block_size, W=36 \(D / 2 bytes of codes, "
         r"2 per group's scale\)\]"),
        (dict(v_cache=torch.zeros(4, 2, 16, 36, dtype=torch.int8)), r"v_cache must be a 4-D tensor of dtype "
                                                                   r"torch.uint8"),
        (dict(v_fp8=None, v_cache=torch.zeros(4, 2, 16, 64), v_token_scales=ts),
         r"v_token_scales given, but V \(torch.float32\) stores plain values"),
        (dict(v_fp8=object()), r"store_kv: v_fp8: fp8=.* is not an FP8 format"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            store_kv(**on_device({**args, **change}))


# ---- the attention ------------------------------------------------------------------------------------------------

@dataclass
class PairProblem:
    query: torch.Tensor            # [T, Hq, D]
    k: Side
    v: Side
    meta: AttentionMetadata
    tables: list[list[int]]
    v_max: float


def _build(pair: tuple[str, str], q_dtype: torch.dtype, *, query_lens: tuple[int, ...], seq_lens: tuple[int, ...],
           head_dim: int = 64, kv_heads: int = 2, group: int = 2, block_size: int = 16, window: int | None = None,
           seed: int = 0) -> PairProblem:
    """K and V caches of the pair's formats holding the batch's context (shuffled blocks, poison elsewhere), the
    metadata and the queries."""
    g = torch.Generator().manual_seed(seed)
    bs, d = block_size, head_dim
    nblocks = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(nblocks) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in nblocks]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, s in zip(tables, seq_lens) for p in range(s)])
    k, v = (Side.poisoned(n, num_blocks, kv_heads, bs, d) for n in pair)
    key = torch.randn(len(slots), kv_heads, d, generator=g) * (1.0 + 3.0 * torch.rand(d, generator=g))
    value = torch.randn(len(slots), kv_heads, d, generator=g)
    k.store(key, 0, slots)
    v.store(value, 1, slots)
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, bs, sliding_window=window)
    query = (1.5 * torch.randn(sum(query_lens), kv_heads * group, d, generator=g)).to(q_dtype)
    return PairProblem(query, k, v, meta, tables, 1.25 * float(value.abs().max()))


def _reference(p: PairProblem, scale: float) -> torch.Tensor:
    """Plain torch over each side's decoded K and V: float32 scores, mask (causal, window) and softmax."""
    out = torch.empty(p.query.shape, dtype=torch.float32)
    m = p.meta
    for i in range(m.num_seqs):
        start, q_len, s_len = int(m.query_start_loc[i]), m.query_lens_list[i], m.seq_lens_list[i]
        if q_len == 0:
            continue
        k = p.k.read(p.tables[i], s_len, 0)
        v = p.v.read(p.tables[i], s_len, 1)
        group = p.query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = p.query[start:start + q_len].float()
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        q_pos = torch.arange(s_len - q_len, s_len).unsqueeze(1)
        k_pos = torch.arange(s_len).unsqueeze(0)
        hidden = k_pos > q_pos
        if m.sliding_window is not None:
            hidden |= k_pos <= q_pos - m.sliding_window
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[start:start + q_len] = torch.einsum("hqs,shd->qhd", probs, v)
    return out


def _attend(p: PairProblem, device: str, num_kv_splits: int | None = 1) -> torch.Tensor:
    m = p.meta
    query = p.query.to(device)
    out = torch.full_like(query, 7.0)
    unified_attention(
        query, p.k.cache.to(device), p.v.cache.to(device), out, query_start_loc=m.query_start_loc.to(device),
        seq_lens=m.seq_lens.to(device), block_tables=m.block_tables.to(device),
        max_query_len=max(m.query_lens_list), max_seq_len=max(m.seq_lens_list), scale=p.query.shape[2] ** -0.5,
        sliding_window=m.sliding_window, fp8=p.k.codes, v_fp8=p.v.codes,   # type: ignore[arg-type]
        k_token_scales=None if p.k.token_scales is None else p.k.token_scales.to(device),
        v_token_scales=None if p.v.token_scales is None else p.v.token_scales.to(device),
        num_kv_splits=num_kv_splits)
    return out.cpu()


def _check(p: PairProblem, out: torch.Tensor) -> None:
    """As the single-format tests' tolerance: float32 level for a float32 query, the dtype's rounding (and the
    probabilities' rounding for the PV product) for a 16-bit one."""
    ref = _reference(p, p.query.shape[2] ** -0.5)
    assert not out.isnan().any(), "NaN in the output: the kernel read a poisoned slot"
    eps = 1e-5 if p.query.dtype == torch.float32 else torch.finfo(p.query.dtype).eps
    torch.testing.assert_close(out.float(), ref, rtol=eps, atol=eps * p.v_max)
    assert out.dtype == p.query.dtype


# a decode row, a prefill chunk over cached context (its own launch: more new tokens than a decode tile holds), a
# fresh prefill
MIXED = dict(query_lens=(1, 6, 11), seq_lens=(37, 40, 11))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_pair_attention_mixed_batch(pair: tuple[str, str], device: str) -> None:
    """Decode and prefill rows of one batch (two launches) over each pair, bfloat16 queries."""
    p = _build(pair, torch.bfloat16, **MIXED)  # type: ignore[arg-type]
    _check(p, _attend(p, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair,q_dtype,group,window,splits", [
    (K8V4, torch.float16, 4, 20, 2),
    (("fp8_e4m3", "fp4_e2m1"), torch.float32, 2, 9, 1),
    (("bfloat16", "int8_per_token_head"), torch.float16, 1, None, 3),
], ids=["k8v4-gqa4-window-split", "fp8-fp4-f32-window", "bf16-int8-f16q-split"])
def test_pair_attention_gqa_window_split(pair: tuple[str, str], q_dtype: torch.dtype, group: int,
                                         window: int | None, splits: int, device: str) -> None:
    """GQA, a sliding window and split-K over decode rows (one long) and a short chunk; a float16 query over a
    bfloat16 K side multiplies float32 operands."""
    p = _build(pair, q_dtype, query_lens=(1, 1, 3), seq_lens=(70, 17, 30), group=group, window=window)
    _check(p, _attend(p, device, splits))


def test_attention_validation_names_the_side() -> None:
    """A pair's per-side token scales and row widths are checked before any launch."""
    p = _build(K8V4, torch.bfloat16, query_lens=(1,), seq_lens=(5,))
    m = p.meta
    base: dict[str, Any] = dict(query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_tables=m.block_tables,
                max_query_len=1, max_seq_len=5, scale=0.125, sliding_window=None, fp8=p.k.codes, v_fp8=p.v.codes,
                k_token_scales=p.k.token_scales, v_token_scales=None)
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(k_token_scales=None), r"k_token_scales=None, but K's int8 codes need a scale per token and head"),
        (dict(v_token_scales=p.k.token_scales), r"v_token_scales given, but V \(int4_g32\) keeps a scale per group"),
        (dict(k_scale=torch.ones(1, 1), v_scale=torch.ones(1, 1)), r"a cache of two formats takes no static scales"),
        (dict(v_cache=torch.zeros(p.v.cache.shape[:3] + (64,), dtype=torch.uint8)),
         r"v_cache row width=64 != 36, the bytes of query head_dim=64 in two codes per byte and 2 per group of 32's"),
        (dict(v_cache=p.v.cache.view(torch.int8)),
         r"v_cache.dtype=torch.int8 but v_fp8='int4_g32' needs torch.uint8"),
        (dict(v_cache=p.v.cache[:1]), r"must share \[num_blocks, Hkv, bs\]"),
    ]
    for change, message in cases:
        kwargs = {**base, **change}
        v_cache = kwargs.pop("v_cache", p.v.cache)
        with pytest.raises(ValueError, match=message):
            unified_attention(p.query, p.k.cache, v_cache, torch.empty_like(p.query), **kwargs)


def test_single_format_variants_pass_k_constexprs_to_v() -> None:
    """A single-format launch's V constexprs are K's (the same kernel as before the split); k8v4 at Llama-3.1-8B
    decode shapes takes the group formats' decode tiles: 64 keys, 4 warps, the 255-register cap, bfloat16
    operands, each side decoded by its own format."""
    from tests.helpers.sm90 import llama_attention_launches

    for kv in ("int8", "int4_per_group32", "fp8_e4m3", "bfloat16"):
        for launch in llama_attention_launches(kv, "decode"):
            kw = launch.kwargs
            if "V_FMT" in kw:
                assert (kw["V_FMT"], kw["V_NATIVE"], kw["V_SCALES"], kw["V_PACKED"], kw["V_GROUPED"],
                        kw["V_ROW_ALIGN"]) == (kw["FP8_FMT"], kw["NATIVE_FP8"], kw["SCALES"], kw["PACKED"],
                                               kw["GROUPED"], kw["ROW_ALIGN"]), kv
    (launch,) = [x for x in llama_attention_launches("k8v4", "decode") if "V_FMT" in x.kwargs]
    kw = launch.kwargs
    assert kw["FP8_FMT"] == kernel_format(INT8) and kw["V_FMT"] == kernel_format(INT4_G32)
    assert (kw["SCALES"], kw["V_SCALES"]) == (triton_attention.SCALES_DYNAMIC, triton_attention.SCALES_NONE)
    assert (kw["PACKED"], kw["GROUPED"], kw["V_PACKED"], kw["V_GROUPED"]) == (False, False, True, True)
    assert (kw["ROW_ALIGN"], kw["V_ROW_ALIGN"]) == (16, 8)   # 128-byte K rows, 72-byte V rows: each side its own
    assert (kw["TILE_N"], kw["num_warps"], kw["maxnreg"]) == (64, 4, 255)
    assert kw["DOT_DTYPE"] == triton_attention._TL_DTYPES[torch.bfloat16]
    variant = triton_attention.KernelVariant(torch.bfloat16, torch.int8, kernel_format(INT8), False,
                                             triton_attention.SCALES_DYNAMIC, False, False, 4, 128, 16, 1, 16)
    assert variant.v_fp8 is SAME_AS_K and not variant.pair
    assert Platform.cuda((9, 0), "H100", compute_units=132).native_fp8   # the launches above are for an H100
