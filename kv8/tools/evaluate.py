"""``kv8 eval``: how much a KV-cache configuration changes a model's predictions.

Everything runs through the real engine with the real paged cache. One engine is built per configuration
(``kv_cache_dtype`` plus an optional ``quantization_param_path``) and one reference engine with a float32
cache; all use the same model, compute dtype and data.

Teacher-forced scoring: the data is cut into consecutive windows of ``window`` tokens (see
:mod:`kv8.tools.data`). Each window is one prompt; the engine's observer (:mod:`kv8.observer`) hands over the full
next-token distribution of every prompt position, and the second half of the window is scored (positions
``window//2 - 1 .. window - 2`` predicting tokens ``window//2 .. window - 1``), so every scored token has at
least ``window//2`` tokens of context. Per configuration, over all scored tokens:

* perplexity ``exp(mean NLL)`` and its difference to the reference's (ΔPPL);
* mean KL divergence ``KL(P_ref || P_cfg)`` of the next-token distributions (natural log, nats);
* top-1 agreement: the fraction of positions whose argmax equals the reference's;
* greedy agreement: ``gen_prompts`` prompts of ``gen_prompt_len`` tokens (consecutive windows of the data)
  are continued greedily for ``gen_tokens`` tokens; reported are the mean number of tokens generated before
  the first divergence from the reference and the fraction of continuations identical to it;
* per layer, the relative RMS error of the cache round trip ``decode(encode(x))`` of everything stored
  (K and V separately) and the fraction of values clipped by the fp8 range;
* a recommendation (:meth:`EvalReport.recommendation`): the FP8 configuration with the lowest KLD, and which
  of the others it beats by more than the spread between windows (which configuration is best depends on the
  model: docs/accuracy.md).

Attention backend: by default every engine uses the ``reference`` backend, which dequantizes any cache to
float32 and attends identically, so the differences measured come only from what the cache stores. With
``attention_backend="auto"`` (what ``kv8 generate`` uses) a fused kernel may compute differently for
different cache dtypes, and its numerics are part of the comparison (e.g. a bfloat16 cache then no longer
matches the float32 reference exactly under bfloat16 compute).

Chunked prefill does not change what is measured: a window longer than ``max_num_batched_tokens`` is
prefilled in several steps, but every chunk attends over the same stored (quantized) bytes, which is what
an fp8 cache means; only float rounding of the unquantized arithmetic may differ between chunkings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from tqdm.auto import tqdm

from kv8.cache.budget import blocks_to_hold
from kv8.cache.codec import KVCodec
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.observer import EngineObserver
from kv8.quant.formats import resolve_kv_cache_dtypes
from kv8.quant.rotation import canonical_rotation
from kv8.sampling_params import SamplingParams
from kv8.tools.calibrate import build_engine, cache_size_options, check_length, model_arch, run_prompts
from kv8.tools.data import read_corpus, require_bos, start_with_bos, token_windows, tokenize_corpus
from kv8.validators import check_int

__all__ = ["ConfigResult", "EvalReport", "KVConfig", "QuantErrorObserver", "Scorer", "evaluate", "score_window"]

DEFAULT_CONFIGS = ("bfloat16", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class KVConfig:
    """One configuration to evaluate: engine options (:class:`EngineArgs` fields, by their names) that set what
    the cache stores -- ``kv_cache_dtype``, optionally a scales file, the scale mode and rotation -- and the
    weights' ``quantization`` (None: as loaded; the float32-cache reference always has the loaded weights, so a
    configuration with FP8 weights measures both errors together).

    ``kv8 eval --config "--kv-cache-dtype fp8 --kv-cache-rotation hadamard"`` gives them as the engine's own flags
    (:meth:`from_flags`). The :attr:`label` that names a configuration in reports is short: the dtype, then
    ``+dynamic``, ``+hadamard``, ``+fp8-weights`` (``+gguf-weights``), ``+plan:FILE`` and ``:SCALES`` for the
    options that differ from the default. With ``kv_cache_plan`` (a per-layer plan file, :mod:`kv8.cache.plan`)
    ``kv_cache_dtype`` is the format of the layers the file does not name."""

    kv_cache_dtype: str
    quantization_param_path: str | None = None
    kv_cache_scale_mode: str = "static"
    kv_cache_rotation: str = "none"
    quantization: str | None = None
    kv_cache_plan: str | None = None

    def __post_init__(self) -> None:
        # Checked here, before any engine loads weights; the names (aliases included) are the engine's. The other
        # options are checked by the engine's configs when its engine is built; the rotation is kept canonical
        # ("hadamard/hadamard" is "hadamard") so that equal configurations have equal labels.
        resolve_kv_cache_dtypes(self.kv_cache_dtype, torch.float32)
        object.__setattr__(self, "kv_cache_rotation", canonical_rotation(self.kv_cache_rotation))

    @staticmethod
    def from_flags(text: str) -> KVConfig:
        """A configuration from engine flags, e.g. ``--kv-cache-dtype fp8_e4m3 --quantization-param-path s.json``
        (the flags of :data:`CONFIG_OPTIONS`; ``--kv-cache-dtype`` is required), or a KV cache dtype alone
        (``fp8_e5m2``: ``--kv-cache-dtype fp8_e5m2``). ``ValueError`` names what is wrong."""
        if text.strip() and not text.strip().startswith("-"):
            return KVConfig(text.strip())
        given = EngineArgs.parse_flags(text, include=CONFIG_OPTIONS, what="--config")
        if "kv_cache_dtype" not in given:
            raise ValueError(f"--config {text!r} names no --kv-cache-dtype; every configuration needs one, e.g. "
                             '"--kv-cache-dtype fp8_e4m3 --kv-cache-rotation hadamard"')
        return KVConfig(**given)

    def engine_options(self) -> dict[str, Any]:
        """The configuration as :class:`EngineArgs` overrides."""
        return {name: getattr(self, name) for name in CONFIG_OPTIONS}

    @property
    def label(self) -> str:
        return (self.kv_cache_dtype + ("+dynamic" if self.kv_cache_scale_mode == "dynamic" else "")
                + (f"+{self.kv_cache_rotation}" if self.kv_cache_rotation != "none" else "")
                + (f"+{self.quantization}-weights" if self.quantization not in (None, "none") else "")
                + (f"+plan:{self.kv_cache_plan}" if self.kv_cache_plan else "")
                + (f":{self.quantization_param_path}" if self.quantization_param_path else ""))


#: the engine options a configuration sets (every other engine option is common to all configurations)
CONFIG_OPTIONS = tuple(f.name for f in fields(KVConfig))


class QuantErrorObserver(EngineObserver):
    """Measures the cache round-trip error of every stored K/V (through the cache's codec) and hands prompt
    logits to ``prompt_rows`` while it is set."""

    def __init__(self, num_layers: int) -> None:
        self.err_sq = torch.zeros(2, num_layers, dtype=torch.float64)
        self.ref_sq = torch.zeros(2, num_layers, dtype=torch.float64)
        self.clipped = torch.zeros(2, num_layers, dtype=torch.int64)
        self.count = torch.zeros(2, num_layers, dtype=torch.int64)
        self.prompt_rows: Callable[[str, int, torch.Tensor], None] | None = None

    def on_kv_store(self, layer: int, key: torch.Tensor, value: torch.Tensor, codec: KVCodec) -> None:
        for i, x in enumerate((key, value)):
            xf = x.float()
            back, clipped = codec.round_trip(x, layer, i)
            if i == 0:   # keys in the model's basis: centering and scaling undone, errors relative to the keys
                xf, back = codec.keys_from_stored(xf, layer), codec.keys_from_stored(back, layer)
            self.err_sq[i, layer] += float(((back - xf) ** 2).sum())
            self.ref_sq[i, layer] += float((xf ** 2).sum())
            self.count[i, layer] += xf.numel()
            self.clipped[i, layer] += clipped

    def on_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
        if self.prompt_rows is not None:
            self.prompt_rows(request_id, start, logits)

    def relative_rms_error(self) -> torch.Tensor:
        """[2, L]: sqrt(sum err^2 / sum x^2) per (K|V, layer)."""
        return torch.sqrt(self.err_sq / self.ref_sq.clamp(min=1e-300))

    def clipped_fraction(self) -> torch.Tensor:
        return self.clipped.double() / self.count.clamp(min=1).double()


@dataclass(frozen=True)
class ConfigResult:
    label: str
    kv_cache_dtype: str                      # canonical name
    scales_source: str | None
    bytes_per_token: int
    perplexity: float
    delta_ppl: float                         # perplexity - reference perplexity
    mean_nll: float
    mean_kld: float                          # nats per scored token
    max_kld: float
    top1_agreement: float
    greedy_mean_match: float | None          # tokens before the first divergence, mean over prompts (None: no
    greedy_identical: float | None           # greedy prompts); fraction of prompts with identical continuations
    layer_k_rel_err: list[float] = field(default_factory=list)
    layer_v_rel_err: list[float] = field(default_factory=list)
    layer_k_clipped: list[float] = field(default_factory=list)
    layer_v_clipped: list[float] = field(default_factory=list)
    layer_k_scale_max: list[float] | None = None   # largest K/V scale of each layer (fp8 only)
    layer_v_scale_max: list[float] | None = None
    window_kld: list[float] = field(default_factory=list)   # mean KLD of each window's scored tokens, in order


@dataclass(frozen=True)
class EvalReport:
    model: str
    dtype: str
    attention_backend: str
    window: int
    num_windows: int
    scored_tokens: int
    gen_prompts: int
    gen_prompt_len: int
    gen_tokens: int
    reference: ConfigResult
    results: list[ConfigResult]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> EvalReport:
        """Inverse of :meth:`to_dict` (e.g. to print the table of a saved ``--json`` report)."""
        fields_ = dict(d)
        fields_["reference"] = ConfigResult(**d["reference"])
        fields_["results"] = [ConfigResult(**r) for r in d["results"]]
        return EvalReport(**fields_)

    def table(self) -> str:
        rows = [self.reference, *self.results]
        w = max(len(r.label) for r in rows) + 2
        head = (f"{'kv cache':<{w}}{'bytes/tok':>10}{'PPL':>10}{'ΔPPL':>9}{'KLD':>10}{'top-1':>8}"
                f"{'greedy':>8}{'same':>6}{'K err':>8}{'V err':>8}")
        lines = [f"model {self.model} (compute {self.dtype}, attention {self.attention_backend}); "
                 f"{self.num_windows} windows of {self.window} tokens, {self.scored_tokens} scored; greedy: "
                 f"{self.gen_prompts} prompts x {self.gen_tokens} tokens; reference: float32 cache", head]
        for r in rows:
            k_err = max(r.layer_k_rel_err, default=0.0)
            v_err = max(r.layer_v_rel_err, default=0.0)
            lines.append(f"{r.label:<{w}}{r.bytes_per_token:>10}{r.perplexity:>10.4f}{r.delta_ppl:>+9.4f}"
                         f"{r.mean_kld:>10.2e}{r.top1_agreement:>8.4f}{_cell(r.greedy_mean_match, 8, '.1f')}"
                         f"{_cell(r.greedy_identical, 6, '.2f')}{k_err:>8.4f}{v_err:>8.4f}")
        lines.append("KLD = mean KL(reference || config) in nats; greedy = mean tokens before the first divergence; "
                     "same = fraction of identical greedy continuations; K/V err = worst layer's relative RMS "
                     "round-trip error")
        advice = self.recommendation()
        if advice is not None:
            lines.append(advice)
        return "\n".join(lines)

    def recommendation(self) -> str | None:
        """One line naming the quantized (FP8 or int8) configuration with the lowest KLD, and which others it beats
        by more than the windows' spread: for each, the per-window KLD differences (paired: the same windows) must
        average more than twice their standard error. None with fewer than two quantized configurations."""
        fp8 = [r for r in self.results
               if any(d.is_quantized for d in resolve_kv_cache_dtypes(r.kv_cache_dtype, torch.float32))]
        if len(fp8) < 2:
            return None
        best = min(fp8, key=lambda r: r.mean_kld)
        ahead: list[str] = []
        tied: list[str] = []
        for r in fp8:
            if r is best:
                continue
            diffs = [a - b for a, b in zip(r.window_kld, best.window_kld)]
            n = len(diffs)
            mean = sum(diffs) / n if n else 0.0
            se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else math.inf
            (ahead if mean > 2 * se else tied).append(f"{r.label} ({r.mean_kld:.2e})")
        kinds = "FP8" if all(r.kv_cache_dtype.startswith("fp8") for r in fp8) else "quantized"
        line = (f"recommendation: {best.label} has the lowest KLD of the {len(fp8)} {kinds} configurations "
                f"({best.mean_kld:.2e})")
        if ahead:
            line += f"; it beats {', '.join(ahead)} by more than twice the spread between windows"
        if tied:
            line += (f"; {', '.join(tied)} cannot be told apart from it on these {self.num_windows} windows (more "
                     "--num-windows would)")
        return line


def _cell(value: float | None, width: int, spec: str) -> str:
    """A table cell, ``-`` for a metric that was not measured (None; NaN in reports written before)."""
    if value is None or math.isnan(value):
        return f"{'-':>{width}}"
    return f"{value:>{width}{spec}}"


class Scorer:
    """Per-configuration accumulators of the teacher-forced metrics."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.kld = 0.0
        self.max_kld = 0.0
        self.top1 = 0
        self.n = 0
        self.window_kld: list[float] = []

    def add(self, logp: torch.Tensor, ref_logp: torch.Tensor, targets: torch.Tensor) -> None:
        """One window's scored positions."""
        self.nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        kld = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        self.kld += float(kld.sum())
        self.window_kld.append(float(kld.mean()))
        self.max_kld = max(self.max_kld, float(kld.max()))
        self.top1 += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
        self.n += targets.numel()


def score_window(engine: LLMEngine, obs: QuantErrorObserver, tokens: list[int], first_pos: int) -> torch.Tensor:
    """Log-probabilities ``[len(tokens) - 1 - first_pos, V]`` of positions ``first_pos .. len - 2``."""
    rows: dict[int, torch.Tensor] = {}

    def hook(request_id: str, pos: int, logits: torch.Tensor) -> None:
        for j in range(logits.shape[0]):
            if pos + j >= first_pos:
                rows[pos + j] = logits[j]

    obs.prompt_rows = hook
    try:
        run_prompts(engine, [tokens], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), 1)
    finally:
        obs.prompt_rows = None
    want = range(first_pos, len(tokens) - 1)
    if sorted(rows) != list(want):
        raise RuntimeError(f"prompt-logits hook saw positions {sorted(rows)[:3]}..., expected {want}")
    return torch.log_softmax(torch.stack([rows[p] for p in want]).double(), dim=-1)


def _greedy_match(ref: list[int], other: list[int]) -> int:
    n = 0
    for a, b in zip(ref, other):
        if a != b:
            break
        n += 1
    return n


def evaluate(model: str, data: Sequence[str], configs: Sequence[KVConfig], *, window: int = 512,
             num_windows: int = 16, skip_tokens: int = 0, gen_prompts: int = 8, gen_prompt_len: int = 32,
             gen_tokens: int = 32, dtype: str = "auto", max_num_batched_tokens: int = 2048,
             attention_backend: str = "reference", add_bos: bool = False, show_progress: bool = True) -> EvalReport:
    """Evaluate every configuration in ``configs`` against a float32 cache; see the module docstring. With
    ``add_bos`` every window and greedy prompt starts with the model's BOS token in place of its first
    (:func:`kv8.tools.data.start_with_bos`)."""
    if not configs:
        raise ValueError("no KV cache configurations to evaluate; give --config or --kv-cache-dtype")
    for name, value, low in (("window", window, 4), ("num_windows", num_windows, 1), ("gen_prompts", gen_prompts, 0),
                             ("gen_prompt_len", gen_prompt_len, 1), ("gen_tokens", gen_tokens, 1)):
        check_int(name, value, low)
    docs = read_corpus(data)
    check_length(model, window, "window")
    check_length(model, gen_prompt_len + gen_tokens, "gen_prompt_len + gen_tokens")
    block_size = 16
    max_len = max(window, gen_prompt_len + gen_tokens) + 1
    arch = model_arch(model)
    bos = require_bos(arch.bos_token_id) if add_bos else None
    layer_windows = arch.layer_windows
    one = blocks_to_hold(layer_windows, max_len, block_size, 1)
    many = blocks_to_hold(layer_windows, gen_prompt_len + gen_tokens + 1, block_size, max(gen_prompts, 1))
    # the cache holds one scoring window or all greedy prompts at once (a plan's pools: a byte budget that does)
    seqs, length = (1, max_len) if one >= many else (max(gen_prompts, 1), gen_prompt_len + gen_tokens + 1)
    sizes = {pools: cache_size_options(arch, length, block_size, seqs, pools) for pools in (False, True)}
    common = dict(dtype=dtype, enable_prefix_caching=False, max_model_len=max_len, max_num_seqs=max(gen_prompts, 1),
                  max_num_batched_tokens=max_num_batched_tokens, attention_backend=attention_backend)
    all_configs = [KVConfig("float32"), *configs]
    num_layers = arch.num_layers
    engines: list[LLMEngine] = []
    observers: list[QuantErrorObserver] = []
    for cfg in all_configs:
        obs = QuantErrorObserver(num_layers)
        engine = build_engine(model, observer=obs, **cfg.engine_options(), **sizes[cfg.kv_cache_plan is not None],
                              **common)
        engines.append(engine)
        observers.append(obs)
    tokens = tokenize_corpus(docs, engines[0].tokenizer)
    windows = token_windows(tokens, window, num_windows, skip_tokens, "--window", "--skip-tokens")
    if bos is not None:
        windows = start_with_bos(windows, bos)
    first = window // 2 - 1
    scorers = [Scorer() for _ in all_configs]
    with tqdm(total=len(windows), desc="Scoring windows", unit="window", disable=not show_progress) as bar:
        for w in windows:
            targets = torch.tensor(w[first + 1:])
            ref_logp = score_window(engines[0], observers[0], w, first)
            scorers[0].add(ref_logp, ref_logp, targets)
            for engine, obs, scorer in zip(engines[1:], observers[1:], scorers[1:]):
                scorer.add(score_window(engine, obs, w, first), ref_logp, targets)
            bar.update(1)
    greedy: list[dict[str, list[int]]] = []
    if gen_prompts:
        prompts = token_windows(tokens, gen_prompt_len, gen_prompts, skip_tokens, "--gen-prompt-len",
                                "--skip-tokens")
        if bos is not None:
            prompts = start_with_bos(prompts, bos)
        params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
        for engine in tqdm(engines, desc="Greedy generation", unit="config", disable=not show_progress):
            greedy.append(run_prompts(engine, prompts, params, len(prompts)))
    ref_ppl = math.exp(scorers[0].nll / scorers[0].n)
    results = []
    for cfg, engine, obs, sc, i in zip(all_configs, engines, observers, scorers, range(len(engines))):
        matches = [_greedy_match(greedy[0][rid], greedy[i][rid]) for rid in greedy[0]] if greedy else []
        err, clipped = obs.relative_rms_error(), obs.clipped_fraction()
        sc_k = sc_v = None
        if engine.cache.scales is not None:
            sc_k = engine.cache.scales.k.amax(dim=(1, 2)).tolist()
            sc_v = engine.cache.scales.v.amax(dim=(1, 2)).tolist()
        ppl = math.exp(sc.nll / sc.n)
        results.append(ConfigResult(
            label=cfg.label if i else "float32 (reference)", kv_cache_dtype=engine.config.cache.default_spec.name,
            scales_source=engine.cache.scales.source if engine.cache.scales is not None else None,
            bytes_per_token=engine.config.kv_budget().bytes_per_token,
            perplexity=ppl, delta_ppl=ppl - ref_ppl, mean_nll=sc.nll / sc.n, mean_kld=sc.kld / sc.n,
            max_kld=sc.max_kld, top1_agreement=sc.top1 / sc.n,
            greedy_mean_match=sum(matches) / len(matches) if matches else None,
            greedy_identical=sum(m == gen_tokens for m in matches) / len(matches) if matches else None,
            layer_k_rel_err=err[0].tolist(), layer_v_rel_err=err[1].tolist(),
            layer_k_clipped=clipped[0].tolist(), layer_v_clipped=clipped[1].tolist(),
            layer_k_scale_max=sc_k, layer_v_scale_max=sc_v, window_kld=sc.window_kld))
    return EvalReport(model=model, dtype=str(engines[0].config.dtype).replace("torch.", ""),
                      attention_backend=engines[0].runner.backend.name, window=window,
                      num_windows=len(windows), scored_tokens=scorers[0].n, gen_prompts=gen_prompts if greedy else 0,
                      gen_prompt_len=gen_prompt_len, gen_tokens=gen_tokens, reference=results[0], results=results[1:])
