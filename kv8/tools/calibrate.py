"""``kv8 calibrate``: compute fp8 KV-cache scales by running a model over calibration text.

The model runs through the real engine (scheduler, runner, paged cache) with a float32 cache, i.e. nothing
is quantized, and an observer (:class:`_KVWatch`, :mod:`kv8.observer`) sees exactly the post-RoPE K and V of
every prompt token that the cache is asked to store, in the basis the cache stores them.
Samples are consecutive windows of ``seq_len`` tokens from the data (see :mod:`kv8.tools.data`), each sent
as one prompt with ``max_tokens=1`` (the sampled token is never stored), with prefix caching off and a cache
large enough for one batch of samples, so every token is computed and observed exactly once.

Scales are ``statistic * headroom / format max`` per scale group, by default over the keys'
position-invariant envelope, with V given one more power of two of headroom, and rounded up to powers of
two, so that they hold at positions calibration never saw and can never round a value worse than scale 1.0
does short of clipping (:mod:`kv8.tools.kv_stats`). Outputs
(:mod:`kv8.tools.export`): a vLLM ``kv_cache_scales.json`` (tensor granularity; one scale per layer, the
larger of K and V), a kv8 scales JSON (any granularity, K and V separate), or a copy of the model directory
with the scales as checkpoint tensors.

Key centering (``key_centering=True``, ``kv8 calibrate --key-centering``; :mod:`kv8.quant.key_offsets`): a first
pass over the same windows measures the mean post-RoPE key per (layer, KV head, channel); the second computes the
scales of the *centered* keys (``(k - c) R``, what such a cache stores). Both go into a kv8 scales file, which
turns key centering on in every engine that loads it, for any cache format.

Key scaling (``key_scaling=True``, ``kv8 calibrate --key-centering --key-scaling``; :mod:`kv8.quant.key_scaling`):
the first pass also measures the mean squared centered key and query per (layer, KV head, channel) and writes the
factors ``s`` beside the offsets. The static FP8 scales are still those of the unscaled centered keys (an engine
refuses a static-scale FP8 cache with such a file).

First-key alignment (``align_first_key="int4_per_group32"``, ``kv8 calibrate --key-centering --align-first-key
FORMAT``; :mod:`kv8.tools.first_key`): the first pass also records every window's key at position 0 and moves the
offsets of the heads where that key is the same for every text, so that a ``FORMAT`` cache (with ``rotation``)
stores it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kv8.cache.budget import blocks_to_hold
from kv8.cache.codec import KVCodec
from kv8.distributed.config import ParallelConfig
from kv8.distributed.group import TPGroup
from kv8.distributed.shard import kv_head_shard
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.loader.model import read_model_config
from kv8.loader.sources import resolve_model_path
from kv8.models.config import ModelArchConfig
from kv8.models.registry import arch_config
from kv8.observer import EngineObserver
from kv8.outputs import RequestOutput
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling
from kv8.quant.scales import KVScales, ModelScaleInfo, ScaleGranularity
from kv8.sampling_params import SamplingParams
from kv8.tools.data import read_corpus, require_bos, start_with_bos, token_windows, tokenize_corpus
from kv8.tools.first_key import FirstKeyAlignment, FirstKeyCollector, align_to_first_key, check_alignable
from kv8.tools.kv_stats import ClipCounter, KeyMeanCollector, KVStatsCollector, ScaleRecipe
from kv8.validators import check_int

__all__ = ["CalibrationResult", "ClipCheck", "build_engine", "cache_size_options", "calibrate", "check_length",
           "run_prompts"]


@dataclass(frozen=True)
class ClipCheck:
    """How the scales fare on held-out windows (the ones right after the calibration windows): per layer,
    the fraction of K / V values that would clip and the largest ``|x| / (scale * format max)``."""

    num_tokens: int
    k_clipped: list[float]
    v_clipped: list[float]
    k_worst: list[float]
    v_worst: list[float]

    @property
    def clean(self) -> bool:
        return max(self.k_clipped + self.v_clipped) == 0.0

    def summary(self) -> str:
        if self.clean:
            worst = max(self.k_worst + self.v_worst)
            return (f"held-out check on {self.num_tokens} tokens: no K or V value would clip (largest value at "
                    f"{worst:.2f} of the range)")
        lines = [f"held-out check on {self.num_tokens} tokens: some values would clip:"]
        for name, fracs, worsts in (("K", self.k_clipped, self.k_worst), ("V", self.v_clipped, self.v_worst)):
            bad = [i for i, f in enumerate(fracs) if f > 0]
            if bad:
                lines.append(f"  {name}: layers {bad[:12]}{' ...' if len(bad) > 12 else ''}, up to "
                             f"{max(fracs) * 100:.3g}% of a layer's values, largest at {max(worsts):.3g}x the range "
                             f"(--headroom {max(worsts):.3g} would hold them)")
        return "\n".join(lines)


@dataclass(frozen=True)
class CalibrationResult:
    """Scales plus what they were computed from. ``collector.amax`` holds the exact observed maxima (of the
    keys' envelopes with ``recipe.key_bound="position"``)."""

    scales: KVScales
    recipe: ScaleRecipe
    info: ModelScaleInfo
    num_samples: int
    num_tokens: int
    collector: KVStatsCollector
    check: ClipCheck | None = None
    # Tensor-granularity scales of each tensor-parallel rank, over the KV heads that rank holds (calibrated with
    # tensor_parallel_size > 1); ``scales`` are then those of all heads, what one rank would use.
    rank_scales: tuple[KVScales, ...] | None = None
    # key centering's offsets (the mean post-RoPE key per layer, KV head and channel); the scales describe the
    # centered keys. None without --key-centering.
    key_offsets: KeyOffsets | None = None
    # key scaling's factors (of the centered keys). None without --key-scaling.
    key_scaling: KeyScaling | None = None
    # what aligning the offsets to the first position's key measured and chose (key_offsets are its offsets).
    # None without --align-first-key.
    first_key: FirstKeyAlignment | None = None


class _KVWatch(EngineObserver):
    """Shows every stored K/V to ``sink`` (a :class:`KVStatsCollector` or a :class:`ClipCounter`), every key in
    the model's basis to ``means`` (a :class:`KeyMeanCollector`) and the keys at position 0 to ``first`` (a
    :class:`FirstKeyCollector`). The calibration engine centers nothing."""

    def __init__(self) -> None:
        self.sink: KVStatsCollector | ClipCounter | None = None
        self.means: KeyMeanCollector | None = None
        self.first: FirstKeyCollector | None = None

    def on_attention_inputs(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            codec: KVCodec) -> None:
        if self.means is not None:
            self.means.observe(layer, key, query if self.means.query_sum_sq is not None else None)

    def on_first_keys(self, layer: int, keys: torch.Tensor) -> None:
        if self.first is not None:
            self.first.observe(layer, keys)

    def on_kv_store(self, layer: int, key: torch.Tensor, value: torch.Tensor, codec: KVCodec) -> None:
        if self.sink is not None:
            self.sink.observe(layer, key, value)


def build_engine(model: str, observer: EngineObserver | None = None, **kwargs: object) -> LLMEngine:
    """An :class:`LLMEngine` watched by ``observer``; a model that cannot be loaded raises ValueError naming
    the model. The weights are the checkpoint's as loaded (a GGUF file's blocks dequantized) unless ``quantization``
    names a method: the tools measure the cache, beside a reference with those weights."""
    if kwargs.get("quantization") is None:
        kwargs["quantization"] = "none"
    try:
        return LLMEngine(EngineArgs(model=model, **kwargs), observer)  # type: ignore[arg-type]
    except ValueError:
        raise
    except Exception as e:  # e.g. a corrupt safetensors file: re-raised as a ValueError naming the model
        raise ValueError(f"cannot load model {model!r}: {type(e).__name__}: {e}") from e


def cache_size_options(arch: ModelArchConfig, num_tokens: int, block_size: int, num_seqs: int,
                       pools: bool) -> dict[str, int]:
    """The cache size a tool's engine gets to hold ``num_seqs`` sequences of ``num_tokens`` tokens whole:
    ``num_kv_blocks`` for one pool; with several (a ``kv_cache_plan``, whose pools' blocks the engine splits from a
    byte budget) ``kv_cache_memory``: those blocks at a float32 cache's bytes per token (no format takes more), twice
    over, so each pool's share holds the sequences whatever the plan."""
    blocks = blocks_to_hold(arch.layer_windows, num_tokens, block_size, num_seqs)
    if not pools:
        return dict(num_kv_blocks=blocks, block_size=block_size)
    float32_token = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4
    return dict(kv_cache_memory=2 * blocks * block_size * float32_token, block_size=block_size)


def model_arch(model: str) -> ModelArchConfig:
    """The architecture of ``model`` from its config alone (no weights are read)."""
    return arch_config(read_model_config(*resolve_model_path(model)))


def check_length(model: str, length: int, what: str) -> None:
    """Raise ValueError when ``length`` prompt tokens (plus the one sampled token) exceed the model's context."""
    context = model_arch(model).max_position_embeddings
    if length + 1 > context:
        raise ValueError(f"{what}={length} is too long for the model: its context is {context} positions and one "
                         f"is needed for the sampled token, so at most {context - 1}")


def run_prompts(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams,
                batch: int, progress: tqdm | None = None) -> dict[str, list[int]]:
    """Run ``prompts`` ``batch`` at a time (request ids ``"p<i>"``); returns generated token ids per id."""
    out: dict[str, list[int]] = {}

    def on_output(o: RequestOutput) -> None:
        if o.finished and progress is not None:
            progress.update(1)

    for start in range(0, len(prompts), batch):
        ids = [engine.add_request(prompts[i], params, request_id=f"p{i}")
               for i in range(start, min(start + batch, len(prompts)))]
        for o in engine.run_to_completion(ids, on_output):
            out[o.request_id] = list(o.outputs[0].token_ids)
    return out


def calibrate(model: str, data: Sequence[str], recipe: ScaleRecipe, *, num_samples: int = 64,
              seq_len: int = 512, skip_tokens: int = 0, dtype: str = "auto", batch: int = 4,
              max_num_batched_tokens: int = 2048, attention_backend: str = "auto", rotation: str = "none",
              check_samples: int = 0, tensor_parallel_size: int = 1, key_centering: bool = False,
              key_scaling: bool = False, align_first_key: str | None = None, add_bos: bool = False,
              show_progress: bool = True) -> CalibrationResult:
    """Observe ``num_samples`` windows of ``seq_len`` tokens from ``data`` (after ``skip_tokens``) and
    compute scales by ``recipe``. With ``check_samples > 0`` the next ``check_samples`` windows of the data,
    which calibration did not see, are run too and :class:`ClipCheck` reports which values the scales would
    clip (``result.check``). With ``rotation="hadamard"`` the engine rotates K/V as a cache with
    ``kv_cache_rotation="hadamard"`` stores them, so the scales describe the rotated values (and say so).
    With ``tensor_parallel_size = N > 1`` and tensor granularity, ``result.rank_scales`` holds each rank's
    scales over the KV heads it holds (:func:`kv8.distributed.shard.kv_head_shard`), from the statistics of
    those heads alone (per-head histograms summed), for a vLLM file's ``scaling_factor[tp_rank]``; finer
    granularities need no per-rank scales (an engine cuts them to its heads). The model runs in one process
    either way: it sees every head. With ``key_centering`` a first pass over the same windows measures the key
    offsets (``result.key_offsets``) and the scales (and the held-out check) are of the centered keys; with
    ``key_scaling`` (which needs ``key_centering``) the same pass measures key scaling's factors
    (``result.key_scaling``); with ``align_first_key`` (a KV cache dtype name, which also needs ``key_centering``)
    the offsets are aligned to the first position's key for that format and ``rotation``
    (:func:`kv8.tools.first_key.align_to_first_key`, ``result.first_key``). Raises ValueError for unusable data,
    options or models. With ``add_bos`` every window (the held-out ones too) starts with the model's BOS token in
    place of its first (:func:`kv8.tools.data.start_with_bos`)."""
    for name, value, low in (("num_samples", num_samples, 1), ("seq_len", seq_len, 2), ("batch", batch, 1),
                             ("check_samples", check_samples, 0), ("tensor_parallel_size", tensor_parallel_size, 1)):
        check_int(name, value, low)
    if key_scaling and not key_centering:
        raise ValueError("key_scaling: kv8 writes key scaling's factors only beside key offsets; add key_centering "
                         "(--key-centering)")
    align_dtype = None
    if align_first_key is not None:
        if not key_centering:
            raise ValueError(f"align_first_key={align_first_key!r} moves key offsets; add key_centering "
                             "(--key-centering)")
        try:
            align_dtype = resolve_kv_cache_dtype(align_first_key, torch.float32)
        except ValueError as e:
            raise ValueError(f"align_first_key (--align-first-key): {e}") from None
        check_alignable(align_dtype)
    docs = read_corpus(data)
    check_length(model, seq_len, "seq_len")
    model_config = model_arch(model)
    ParallelConfig(tensor_parallel_size).check_model(model_config)
    bos = require_bos(model_config.bos_token_id) if add_bos else None
    per_rank = tensor_parallel_size > 1 and recipe.granularity is ScaleGranularity.TENSOR
    block_size = 16
    blocks = blocks_to_hold(model_config.layer_windows, seq_len + 1, block_size, batch)
    watch = _KVWatch()
    engine = build_engine(model, watch, dtype=dtype, kv_cache_dtype="float32", enable_prefix_caching=False,
                          max_model_len=seq_len + 1, num_kv_blocks=blocks, block_size=block_size,
                          max_num_seqs=batch, max_num_batched_tokens=max(max_num_batched_tokens, seq_len),
                          attention_backend=attention_backend, kv_cache_rotation=rotation)
    arch = engine.config.arch
    info = ModelScaleInfo(arch.model_type, arch.num_layers, arch.num_kv_heads, arch.head_dim)
    tokens = tokenize_corpus(docs, engine.tokenizer)
    samples = token_windows(tokens, seq_len, num_samples, skip_tokens, "--seq-len", "--skip-tokens")
    if bos is not None:
        samples = start_with_bos(samples, bos)
    rotation_matrix = engine.cache.codec.rotation
    key_offsets, stored_offset, scaling, first_key = None, None, None, None
    if key_centering:
        if not arch.shift_invariant_scores:
            raise ValueError(f"key centering is not exact for this {arch.model_type} model: it "
                             f"{arch.score_transform}")
        watch.means = KeyMeanCollector(arch.num_layers, arch.num_kv_heads, arch.head_dim, queries=key_scaling)
        watch.first = None if align_dtype is None else FirstKeyCollector(arch.num_layers)
        with tqdm(total=len(samples), desc="Key means", unit="sample", disable=not show_progress) as bar:
            run_prompts(engine, samples, SamplingParams(temperature=0.0, max_tokens=1), batch, bar)
        key_offsets = watch.means.offsets(f"kv8 calibrate --key-centering (mean post-RoPE key, {len(samples)} x "
                                          f"{seq_len} tokens)")
        if key_scaling:
            scaling = watch.means.scaling(f"kv8 calibrate --key-scaling ((E[q^2] / E[(k - c)^2])^(1/4), "
                                          f"{len(samples)} x {seq_len} tokens)")
        if watch.first is not None and align_dtype is not None:
            first_key = align_to_first_key(key_offsets, scaling, watch.first.stacked(), align_dtype, rotation)
            key_offsets = first_key.offsets
        watch.means, watch.first = None, None
        stored_offset = key_offsets.k if rotation_matrix is None else key_offsets.k @ rotation_matrix.cpu().float()
    histograms = ScaleGranularity.HEAD if per_rank else recipe.granularity
    collector = KVStatsCollector(arch.num_layers, arch.num_kv_heads, arch.head_dim,
                                 histograms if recipe.needs_histogram else None, recipe.key_bound,
                                 rotation_matrix, stored_offset)
    watch.sink = collector
    with tqdm(total=len(samples), desc="Calibrating", unit="sample", disable=not show_progress) as bar:
        run_prompts(engine, samples, SamplingParams(temperature=0.0, max_tokens=1), batch, bar)
    what = f"{recipe.statistic}" + (f" p{recipe.percentile:g}" if recipe.statistic == "percentile" else "")
    source = (f"kv8 calibrate ({what}, {recipe.granularity.value}, {recipe.fmt.name}, headroom "
              f"{recipe.headroom:g} (V x{recipe.v_headroom:g}), {recipe.key_bound} key bound, "
              f"{'power-of-two' if recipe.power_of_two else 'exact'} scales, {len(samples)} x {seq_len} tokens"
              + (f", {rotation} rotation" if rotation != "none" else "")
              + (", centered keys)" if key_centering else ")"))
    rank_scales = None
    if per_rank:
        scales = collector.heads(0, arch.num_kv_heads).scales(recipe, source, rotation)
        rank_scales = tuple(
            collector.heads(*kv_head_shard(arch.num_kv_heads, TPGroup(r, tensor_parallel_size))).scales(
                recipe, f"{source}, tensor-parallel rank {r} of {tensor_parallel_size}", rotation)
            for r in range(tensor_parallel_size))
    else:
        scales = collector.scales(recipe, source, rotation)
    check = None
    if check_samples:
        held_out = token_windows(tokens, seq_len, check_samples, skip_tokens + len(samples) * seq_len, "--seq-len",
                                 "--skip-tokens and the --num-samples calibration samples; --check-samples needs "
                                 "text beyond them")
        if bos is not None:
            held_out = start_with_bos(held_out, bos)
        counter = ClipCounter(scales, recipe.fmt, stored_offset)
        watch.sink = counter
        with tqdm(total=len(held_out), desc="Checking", unit="sample", disable=not show_progress) as bar:
            run_prompts(engine, held_out, SamplingParams(temperature=0.0, max_tokens=1), batch, bar)
        total = counter.total.clamp(min=1).double()
        frac = (counter.clipped.double() / total).tolist()
        check = ClipCheck(len(held_out) * seq_len, frac[0], frac[1], counter.worst[0].tolist(),
                          counter.worst[1].tolist())
    return CalibrationResult(scales=scales, recipe=recipe, info=info, num_samples=len(samples),
                             num_tokens=len(samples) * seq_len, collector=collector, check=check,
                             rank_scales=rank_scales, key_offsets=key_offsets, key_scaling=scaling,
                             first_key=first_key)
