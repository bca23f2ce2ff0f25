"""The contract every attention backend keeps (:class:`kv8.attention.backend.AttentionBackend`), one table of cases
run against each of ``reference``, ``cpu_fused`` and ``triton`` (Triton's interpreter on CPU tensors without a GPU,
compiled on CUDA tensors with one: :mod:`tests.helpers.triton`).

``forward(q, k, v, cache, layer, meta, scale)`` must

* store: after the call the cache holds, bit for bit, what :meth:`KVCodec.encode` makes of every new token's K and
  V (codes, and with dynamic scales the float32 token scales), at ``meta.slot_mapping`` in ``layer``'s slot, with
  ``layer``'s scales -- and nothing else changes: not the other layer the cache holds, not a slot marked skipped
  (``-1``: the padding rows of the CUDA-graph buffers, :mod:`kv8.engine.cuda_graphs`), not the table entries or
  blocks of nothing. The expected bytes are written here token by token from :meth:`KVCodec.encode`, not by
  :meth:`PagedKVCache.store`, so the reference backend's store is checked too;
* attend: return ``[T, Hq, D]`` in q's dtype equal to attention over the *stored* cache (every new token stored
  before any query attends: a row reads a block another row of the same call writes), computed here in float64
  from the same bytes (FP8, int8 and int4 codes decoded exactly and multiplied by their scales in float64), causal,
  with the sliding window ``p - W < k <= p``;
* leave its inputs alone, and for an empty batch (no rows) return an empty output and write nothing.

Every case starts from a poisoned cache: every slot and token scale that holds no context token is NaN (FP8: the
format's NaN code; int8 and int4, which have none: a code never written -- int8 -128, int4 -8 -- beside a NaN token
scale), and the table entries before a window's first block point at poisoned blocks -- a backend that reads a slot
it must not, or attends before it stores, returns NaN. The new K/V are views of one fused qkv tensor (strided, like
a model's), in the model dtype (the query's), and with a Hadamard codec in its stored basis (as
:class:`kv8.layers.attention.PagedAttention` hands them over). The cache holds model layers 0 and 2 of 3, in slots 1
and 0 (a hybrid layout's slot map): layer 2 runs, layer 0's slot must stay poisoned, and static scales differ per
layer.

Tolerances, ``|out - oracle| <= tol * (1 + max |V|)`` with ``max |V|`` the largest stored value the oracle reads,
by the query's (= output's) dtype, the same for every storage: the oracle reads the exact stored values, so the
cache's format enters only through the bytes, which are checked bit-exactly. What is left is each backend's
arithmetic (float32 softmax and sums; the fast CPU path's bf16 hi+lo operands; Triton's 16-bit PV operands for a
16-bit query, each weight off by <= eps/2 of itself, so by <= eps/2 * max |V| in all) and the output's rounding (an
output is a convex combination of V rows: |out| <= max |V|):

    float32   5e-5     (observed <= ~1e-6: ~0.01 of the bound)
    float16   2^-10    (one fp16 ulp at the top of the range; observed ~0.2 of the bound: the output's rounding)
    bfloat16  2^-7     (one bf16 ulp at the top of the range; likewise)

Every backend supports every cache format here (float32 included). Where a backend does not support a case,
:data:`UNSUPPORTED` says so: an expected ``ValueError`` (asserted, and whether the cache was left untouched or
already holds the new tokens) or a skip with the reason. A bug the contract finds is a strict xfail in
:data:`KNOWN_BUGS` (with its explanation) until it is fixed. Shapes are tiny (head_dim 32, blocks of 16, ~13 new
tokens over <= 64-token contexts): the Triton interpreter takes ~1-2 s a case.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kv8.attention.backend import AttentionBackend, get_backend
from kv8.attention.metadata import AttentionMetadata, token_slot
from kv8.cache.codec import GROUP_FORMATS, K, KVCodec, V
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.kernels.cpu.build import KernelUnavailable
from kv8.quant.formats import resolve_kv_cache_dtype, resolve_kv_cache_dtypes, unpack_int4
from kv8.quant.scales import KVScales, ScaleGranularity
from tests.helpers.kernels import scattered_tables

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

BACKENDS = ("reference", "cpu_fused", "triton")
LAYER = 2                     # the model layer every call runs
SLOTS = {0: 1, LAYER: 0}      # the cache holds model layers 0 and 2 (of 3), in slots 1 and 0
NUM_LAYERS = 3
BLOCK = 16
TOL = {torch.float32: 5e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


@dataclass(frozen=True)
class Row:
    """One sequence of the batch: ``query_len`` new tokens ending at ``seq_len``."""

    query_len: int
    seq_len: int
    shares: int | None = None    # an earlier row whose blocks hold this row's cached prefix (its full blocks)
    skipped: bool = False        # a padding row: its slots are -1 (nothing stored), its output is not compared


# decode over 36 cached tokens; a prefill chunk of 5 over 35 cached; a chunk of 4 that completes a block; a 2-token
# chunk whose cached prefix is that block (prefix sharing: 4 of its keys are stored by the row before, in this same
# call, and only then read); a row with no new token; a decode at the last slot of a block
MIXED = (Row(1, 37), Row(5, 40), Row(4, 16), Row(2, 18, shares=2), Row(0, 5), Row(1, 16))
# a decode batch padded like the CUDA-graph buffers: rows of one query over one key, slot -1
PADDED = (Row(1, 37), Row(1, 16), Row(1, 1, skipped=True), Row(3, 20), Row(1, 1, skipped=True))


@dataclass(frozen=True)
class Case:
    id: str
    kv: str                              # kv_cache_dtype
    scales: str = "none"                 # "tensor" / "head" / "channel" (static), "dynamic", "none" (16/32-bit)
    q_dtype: torch.dtype = torch.bfloat16
    kv_heads: int = 2
    group: int = 2                       # query heads per KV head (1: MHA)
    head_dim: int = 32
    window: int | None = None
    rotation: str = "none"
    rows: tuple[Row, ...] = MIXED
    sink: bool = False                   # q, K, V of an attention sink and a long tail (sink_kv) instead of random
    seed: int = 0


CASES = [
    # every cache format; static scales of every granularity and dynamic scales; GQA unless said otherwise
    Case("bfloat16", "bfloat16", q_dtype=torch.bfloat16, seed=1),
    Case("float16", "float16", q_dtype=torch.float16, seed=2),
    Case("float32", "float32", q_dtype=torch.float32, seed=3),
    Case("e4m3-tensor", "fp8_e4m3", "tensor", torch.bfloat16, seed=4),
    Case("e4m3-channel", "fp8_e4m3", "channel", torch.float32, seed=5),
    Case("e5m2-head", "fp8_e5m2", "head", torch.float32, seed=6),
    Case("hadamard-e4m3fnuz-head", "fp8_e4m3fnuz", "head", torch.bfloat16, rotation="hadamard", seed=7),
    Case("e4m3-dynamic", "fp8_e4m3", "dynamic", torch.float16, seed=8),
    Case("e5m2-dynamic", "fp8_e5m2", "dynamic", torch.bfloat16, seed=9),
    Case("hadamard-e4m3fnuz-dynamic", "fp8_e4m3fnuz", "dynamic", torch.float32, rotation="hadamard", seed=10),
    # int8 codes, a scale per token and KV head (always dynamic)
    Case("int8", "int8_per_token_head", "dynamic", torch.bfloat16, seed=20),
    Case("hadamard-int8", "int8", "dynamic", torch.float32, rotation="hadamard", seed=21),
    # int4 codes, two per byte, a scale per token and KV head (always dynamic)
    Case("int4", "int4_per_token_head", "dynamic", torch.bfloat16, seed=24),
    # MHA, with head_dim 48 (not a power of two)
    Case("mha-e4m3-tensor", "fp8_e4m3", "tensor", torch.float32, kv_heads=3, group=1, head_dim=48, seed=13),
    # sliding windows: smaller than a block (with MQA: one KV head, 4 query heads), and spanning blocks (with a
    # 16/32-bit cache of another dtype than q)
    Case("window5-mqa-e4m3-dynamic", "fp8_e4m3", "dynamic", torch.bfloat16, kv_heads=1, group=4, window=5, seed=14),
    Case("window20-bfloat16", "bfloat16", q_dtype=torch.float32, window=20, seed=15),
    Case("window5-mqa-int8", "int8", "dynamic", torch.float16, kv_heads=1, group=4, window=5, seed=22),
    Case("window5-mqa-hadamard-int4", "int4", "dynamic", torch.float16, kv_heads=1, group=4, window=5,
         rotation="hadamard", seed=25),
    # skipped slots (-1) and the empty batch
    Case("skipped-slots-e5m2-dynamic", "fp8_e5m2", "dynamic", torch.bfloat16, rows=PADDED, seed=16),
    Case("skipped-slots-int8", "int8", "dynamic", torch.bfloat16, rows=PADDED, seed=23),
    Case("empty-e4m3-dynamic", "fp8_e4m3", "dynamic", torch.bfloat16, rows=(), seed=17),
    Case("empty-float32", "float32", q_dtype=torch.float32, rows=(), seed=18),
    # an attention sink over a long tail of small weights: float16 PV operands with E5M2's tiny dynamic V scales
    Case("sink-e5m2-dynamic-float16", "fp8_e5m2", "dynamic", torch.float16, rows=(Row(1, 64), Row(3, 40)), sink=True),
    # the same with int8's scales (amax / 127: p * s ~1.2e-5, float16 subnormals but not 0; see KNOWN_BUGS)
    Case("sink-int8-float16", "int8", "dynamic", torch.float16, rows=(Row(1, 64), Row(3, 40)), sink=True),
    # keys and values in different formats (a K/V pair): each side with its own scales (per token and head, per
    # group in the row, or none), read by its own format
    Case("k8v4", "k8v4", "dynamic", torch.bfloat16, seed=30),
    Case("hadamard-e4m3-int4", "fp8_e4m3/int4", "dynamic", torch.float32, rotation="hadamard", seed=31),
    Case("window5-mqa-bfloat16-int8", "bfloat16/int8", "dynamic", torch.bfloat16, kv_heads=1, group=4, window=5,
         seed=32),
    # past Triton's largest head_dim
    Case("head_dim320-e4m3-head", "fp8_e4m3", "head", torch.bfloat16, head_dim=320, rows=(Row(1, 9), Row(3, 20)),
         seed=19),
]


@dataclass(frozen=True)
class Unsupported:
    """How a backend declines a case: ``error`` (a ValueError matching it) or, without one, a skip; ``why``."""

    why: str
    error: str | None = None
    writes_first: bool = False    # with an error: the new tokens were stored before it (else nothing is written)


UNSUPPORTED = {
    ("triton", "head_dim320-e4m3-head"): Unsupported(
        "the attention kernel takes head_dim 1 .. 256; its store has no such limit and runs first",
        error="head_dim=320", writes_first=True),
}

# Bugs the contract finds, each a strict xfail: the case must fail on that backend until the bug is fixed (then
# XPASS fails the run and the entry goes).
KNOWN_BUGS = {
    ("triton", "sink-e5m2-dynamic-float16"): (
        "with dynamic V scales the kernel multiplies the probabilities by the tokens' scales before rounding them to "
        "the query's dtype for the PV product; E5M2's scales (amax / 57344, ~1e-5 for values ~1) put p * s below "
        "float16's smallest normal (6.1e-5), where its spacing is 2^-24: a weight under ~1.7e-3 of the row's maximum "
        "rounds to 0, so a long tail of small weights drops out of the output (not of the softmax sum)"),
}


# ---- building a case ---------------------------------------------------------------------------------------------

@dataclass
class Problem:
    case: Case
    cache: PagedKVCache           # before the call (CPU): context stored, everything else poisoned
    expected: PagedKVCache        # after a correct call's store (CPU)
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    skipped_tokens: list[int]     # new tokens whose slot is -1
    q: torch.Tensor               # [T, Hq, D] (strided views, stored basis)
    k: torch.Tensor               # [T, Hkv, D]
    v: torch.Tensor
    oracle: torch.Tensor          # [T, Hq, D] float64 (NaN in the rows of skipped tokens: not compared)
    v_max: float                  # the largest |V| the oracle reads

    @property
    def scale(self) -> float:
        return self.case.head_dim ** -0.5

    def meta(self, device: torch.device | str) -> AttentionMetadata:
        meta = AttentionMetadata.build(self.query_lens, self.seq_lens, self.tables, BLOCK,
                                       sliding_window=self.case.window, device=device)
        if not self.skipped_tokens:
            return meta
        slots = meta.slot_mapping.clone()
        slots[self.skipped_tokens] = -1
        return dataclasses.replace(meta, slot_mapping=slots)


def _poison(cache: PagedKVCache) -> None:
    for which, codes in ((K, cache.k_data), (V, cache.v_data)):
        kv_dtype = cache.codec.dtype_of(which)
        fmt = kv_dtype.fp8
        if kv_dtype.group is not None:
            codes.fill_(0xFF)   # codes -1 beside NaN float16 group scales
        elif kv_dtype.int_codes is not None:
            # int8 / int4 have no NaN: a code never written (int8 -128; int4 0x80 = nibbles 0 and -8), beside NaN
            # token scales
            codes.view(torch.uint8).fill_(0x80)
        else:
            codes.fill_(float("nan") if fmt is None else fmt.nan_code)
    for ts in (cache.k_token_scales, cache.v_token_scales):
        if ts is not None:
            ts.fill_(float("nan"))


def _copy(cache: PagedKVCache, device: torch.device | str = "cpu") -> PagedKVCache:
    out = PagedKVCache(cache.shape, cache.codec, cache.slots, device)
    for dst, src in zip(out.tensors, cache.tensors, strict=True):
        dst.copy_(src)
    return out


def write_encoded(cache: PagedKVCache, layer: int, key: torch.Tensor, value: torch.Tensor, slots: list[int]) -> None:
    """What :meth:`KVCodec.encode` makes of ``key``/``value`` ``[n, H, D]``, written token by token into ``slots``
    (negative: skipped) of ``layer``: the store half of the contract, independent of :meth:`PagedKVCache.store`."""
    s = cache.slots[layer]
    for which, x in ((K, key), (V, value)):
        codes, ts = cache.codec.encode(x, layer, which)
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            block, offset = divmod(slot, BLOCK)
            (cache.k_data if which == K else cache.v_data)[s, block, :, offset] = codes[t]
            if ts is not None:
                scales = cache.k_token_scales if which == K else cache.v_token_scales
                assert scales is not None
                scales[s, block, :, offset] = ts[t]


def read_float64(cache: PagedKVCache, layer: int, which: int, slots: list[int]) -> torch.Tensor:
    """The stored K or V of ``slots`` in float64, ``[n, H, D]``: codes decoded exactly, times their scales."""
    s = cache.slots[layer]
    at = [divmod(slot, BLOCK) for slot in slots]
    stored = torch.stack([(cache.k_data if which == K else cache.v_data)[s, b, :, o] for b, o in at])
    fmt = cache.codec.dtype_of(which).codes
    if fmt is None:
        return stored.double()
    if isinstance(fmt, GROUP_FORMATS):     # codes times their group's scale, both in the row (exact in float32)
        return fmt.decode(stored, cache.codec.head_dim, torch.float32).double()
    if cache.codec.packed_of(which):       # int4: two codes per byte
        stored = unpack_int4(stored)
    token_scales = cache.k_token_scales if which == K else cache.v_token_scales
    if token_scales is not None:
        scale = torch.stack([token_scales[s, b, :, o] for b, o in at]).double().unsqueeze(-1)
    else:
        scales = cache.layer_scales(layer)
        assert scales is not None
        scale = scales[which].double()
    return fmt.decode(stored, torch.float64) * scale


def oracle(p: Problem) -> tuple[torch.Tensor, float]:
    """Attention over ``p.expected`` in float64 (query ``j`` of row ``i`` at ``s - q + j`` sees ``p - W < k <= p``),
    and the largest ``|V|`` it reads."""
    c = p.case
    out = torch.full((p.q.shape[0], c.kv_heads * c.group, c.head_dim), math.nan, dtype=torch.float64)
    v_max = 0.0
    start = 0
    for i, (q_len, s_len) in enumerate(zip(p.query_lens, p.seq_lens)):
        rows = slice(start, start + q_len)
        start += q_len
        if q_len == 0 or c.rows[i].skipped:
            continue
        first = 0 if c.window is None else max(0, s_len - q_len + 1 - c.window)
        slots = [token_slot(p.tables[i], pos, BLOCK) for pos in range(first, s_len)]
        k = read_float64(p.expected, LAYER, K, slots).repeat_interleave(c.group, dim=1)     # [S, Hq, D]
        v = read_float64(p.expected, LAYER, V, slots).repeat_interleave(c.group, dim=1)
        v_max = max(v_max, v.abs().max().item())
        scores = torch.einsum("thd,shd->hts", p.q[rows].double(), k) * p.scale
        q_pos = torch.arange(s_len - q_len, s_len)[:, None]
        k_pos = torch.arange(first, s_len)[None, :]
        hidden = (k_pos > q_pos) | (k_pos <= q_pos - (c.window or s_len + 1))
        probs = torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1)
        out[rows] = torch.einsum("hts,shd->thd", probs, v)
    return out, v_max


def calibrated_scales(key: torch.Tensor, value: torch.Tensor, case: Case, gen: torch.Generator) -> KVScales:
    """Static scales for layer :data:`LAYER` like calibrated ones (amax / format max over the granularity's groups,
    times U(0.8, 1.6): some values saturate); the other layers' are 3x those (a backend reading another layer's
    scales writes other bytes)."""
    fmt = resolve_kv_cache_dtype(case.kv, case.q_dtype).fp8
    assert fmt is not None
    dims = {"tensor": (0, 1, 2), "head": (0, 2), "channel": (0,)}[case.scales]
    out = []
    for x in (key, value):
        amax = x.float().abs().amax(dim=dims, keepdim=True)                              # [1, H|1, D|1]
        s = (amax / fmt.max_finite * (0.8 + 0.8 * torch.rand(amax.shape, generator=gen))).clamp_min(1e-6)
        layers = [3.0 * s] * NUM_LAYERS
        layers[LAYER] = s
        out.append(torch.cat(layers))
    return KVScales(k=out[0], v=out[1], granularity=ScaleGranularity(case.scales), source="test", made_for=None,
                    rotation=case.rotation)


def sink_kv(positions: list[int], hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[n, hkv, d]`` of an attention sink: against q = e_0 (scale 1) position 0 scores 0 and every other key
    -6.5 (weight e^-6.5 = 1.5e-3 of the sink's); V is -1 at position 0 and +1 elsewhere."""
    tail = torch.tensor([p != 0 for p in positions])[:, None, None]
    key = torch.zeros(len(positions), hkv, d)
    key[:, :, 0] = torch.where(tail[:, :, 0], -6.5 * d ** 0.5, 0.0)      # the score is q . k * d^-0.5
    return key, torch.where(tail, 1.0, -1.0).expand(-1, hkv, d).clone()


def build(case: Case) -> Problem:
    gen = torch.Generator().manual_seed(case.seed)
    kv_dtype, v_dtype = resolve_kv_cache_dtypes(case.kv, case.q_dtype)
    hq, hkv, d = case.kv_heads * case.group, case.kv_heads, case.head_dim
    query_lens = [r.query_len for r in case.rows]
    seq_lens = [r.seq_len for r in case.rows]
    tables, num_blocks = scattered_tables(seq_lens, BLOCK, gen)
    for i, r in enumerate(case.rows):
        if r.shares is not None:          # the full blocks of this row's cached prefix are those of row r.shares
            n = (r.seq_len - r.query_len) // BLOCK
            assert n >= 1 and case.rows[r.shares].seq_len >= n * BLOCK
            tables[i][:n] = tables[r.shares][:n]
    spare = sorted(set(range(num_blocks)) - {b for t in tables for b in t})   # never written: poisoned
    for i, r in enumerate(case.rows):
        if r.skipped:                     # padding: over one key of a block that holds context (cuda_graphs)
            tables[i] = [tables[0][0]]
        elif case.window is not None and r.query_len:   # entries before the window's first block: anything
            first_block = max(0, r.seq_len - r.query_len + 1 - case.window) // BLOCK
            tables[i][:first_block] = [spare[b % len(spare)] for b in range(first_block)]

    # positions of the cached context each row reads and no row of this call writes, then of the new tokens
    ctx: list[tuple[int, int]] = []       # (slot, position)
    new: list[int] = []
    for i, r in enumerate(case.rows):
        lo = 0
        if r.shares is not None:
            lo = (r.seq_len - r.query_len) // BLOCK * BLOCK
        if case.window is not None and r.query_len:
            lo = max(lo, max(0, r.seq_len - r.query_len + 1 - case.window) // BLOCK * BLOCK)
        if not r.skipped:
            ctx += [(token_slot(tables[i], pos, BLOCK), pos) for pos in range(lo, r.seq_len - r.query_len)]
        new += range(r.seq_len - r.query_len, r.seq_len)
    num_tokens, n_ctx = len(new), len(ctx)
    # K/V of layer LAYER, in the stored basis (rotated as the attention layer does), in the model dtype
    basis = KVCodec.build(kv_dtype, d, rotation=case.rotation,
                          scales=KVScales.default(NUM_LAYERS) if kv_dtype.is_fp8 else None)
    if case.sink:
        assert case.rotation == "none"
        key, value = sink_kv([pos for _, pos in ctx] + new, hkv, d)
        q = torch.zeros(num_tokens, hq, d)
        q[:, :, 0] = 1.0
    else:
        amp = 1.0 + 3.0 * torch.rand(d, generator=gen)             # uneven key channels, like real keys
        key = torch.randn(n_ctx + num_tokens, hkv, d, generator=gen) * amp
        value = torch.randn(n_ctx + num_tokens, hkv, d, generator=gen)
        q = 1.5 * torch.randn(num_tokens, hq, d, generator=gen)
    key, value, q = (basis.to_stored_basis(x, which).to(case.q_dtype) for x, which in ((key, K), (value, V), (q, K)))
    static = None
    if kv_dtype.is_fp8 and case.scales != "dynamic":
        static = calibrated_scales(key, value, case, gen)
    codec = KVCodec.build(kv_dtype, d, scale_mode="dynamic" if case.scales == "dynamic" else "static",
                          rotation=case.rotation, scales=static, v_dtype=v_dtype)
    cache = PagedKVCache(CacheShape(NUM_LAYERS, num_blocks, hkv, BLOCK, d), codec, SLOTS)
    _poison(cache)
    write_encoded(cache, LAYER, key[:n_ctx], value[:n_ctx], [slot for slot, _ in ctx])

    # the new tokens: q, k, v as views of one fused qkv projection (strided rows)
    qkv = torch.cat([q.reshape(num_tokens, hq * d), key[n_ctx:].reshape(num_tokens, hkv * d),
                     value[n_ctx:].reshape(num_tokens, hkv * d)], dim=1)
    q_view, k_view, v_view = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    problem = Problem(case, cache, _copy(cache), query_lens, seq_lens, tables, [], q_view.view(num_tokens, hq, d),
                      k_view.view(num_tokens, hkv, d), v_view.view(num_tokens, hkv, d), torch.empty(0), 0.0)
    start = 0
    for r in case.rows:
        if r.skipped:
            problem.skipped_tokens += list(range(start, start + r.query_len))
        start += r.query_len
    write_encoded(problem.expected, LAYER, problem.k, problem.v, problem.meta("cpu").slot_mapping.tolist())
    problem.oracle, problem.v_max = oracle(problem)
    if num_tokens:
        kept = [t for t in range(num_tokens) if t not in problem.skipped_tokens]
        assert torch.isfinite(problem.oracle[kept]).all(), "the oracle read a poisoned slot: the case is wrong"
    return problem


# ---- the contract ------------------------------------------------------------------------------------------------

def _device(name: str) -> str:
    if name != "triton":
        return "cpu"
    from tests.helpers.triton import DEVICES  # imports Triton (and sees how tests/conftest.py set it up)

    return DEVICES[0]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[AttentionBackend, str]]:
    """(backend, the device its tensors live on). ``cpu_fused`` is skipped, with the reason, where its kernels
    cannot be built."""
    try:
        made = get_backend(request.param)
    except KernelUnavailable as exc:
        pytest.skip(f"{request.param}: fused CPU kernels unavailable: {exc}")
    assert made.name == request.param
    yield made, _device(request.param)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_bytes(got: PagedKVCache, want: PagedKVCache, what: str) -> None:
    names = ("k_data", "v_data", "k_token_scales", "v_token_scales")
    pairs = [(n, getattr(got, n), getattr(want, n)) for n in names if getattr(want, n) is not None]
    assert [n for n in names if getattr(got, n) is not None] == [n for n, _, _ in pairs]
    for name, a, b in pairs:
        a, b = _raw(a.cpu()), _raw(b)
        if not torch.equal(a, b):
            diff = (a != b).nonzero()
            raise AssertionError(f"{what}: cache.{name} differs from KVCodec.encode's bytes in {len(diff)} bytes, "
                                 f"first at {diff[0].tolist()} (slot, K|V, block, head, offset, ...)")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_backend_keeps_the_contract(backend: tuple[AttentionBackend, str], case: Case,
                                    request: pytest.FixtureRequest) -> None:
    be, device = backend
    if (be.name, case.id) in KNOWN_BUGS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[be.name, case.id]))
    p = build(case)
    cache = _copy(p.cache, device)
    meta = p.meta(device)
    q, k, v = (x.to(device) if device != "cpu" else x for x in (p.q, p.k, p.v))
    inputs = [x.clone() for x in (q, k, v)]
    declined = UNSUPPORTED.get((be.name, case.id))
    if declined is not None and declined.error is None:
        pytest.skip(f"{be.name} does not support {case.id}: {declined.why}")
    if declined is not None:
        with pytest.raises(ValueError, match=declined.error):
            be.forward(q, k, v, cache, LAYER, meta, p.scale)
        assert_same_bytes(cache, p.expected if declined.writes_first else p.cache, f"{be.name} refusing {case.id}")
        return

    out = be.forward(q, k, v, cache, LAYER, meta, p.scale)

    assert all(torch.equal(a, b) for a, b in zip((q, k, v), inputs)), "forward changed its inputs"
    assert_same_bytes(cache, p.expected, f"{be.name} storing {case.id}")
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    kept = [t for t in range(q.shape[0]) if t not in p.skipped_tokens]
    got, want = out.cpu()[kept].double(), p.oracle[kept]
    assert not got.isnan().any(), "NaN in the output: a poisoned slot was read (or attended before storing)"
    if got.numel():
        err = (got - want).abs().max().item()
        bound = TOL[case.q_dtype] * (1.0 + p.v_max)
        assert err <= bound, f"max |{be.name} - float64 oracle| = {err:.3g} > {bound:.3g}"
