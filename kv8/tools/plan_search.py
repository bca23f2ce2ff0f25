"""``kv8 calibrate --plan``: a per-layer KV plan (a ``kv_cache_plan`` file) from an accuracy or a bytes budget.

Three steps, every model run through the real engine and paged cache, every KLD measured as ``kv8 eval`` measures
it (:func:`kv8.tools.evaluate.score_window`: the second half of each window scored, mean ``KL(P_ref || P)`` in
nats against the same engine with a float32 cache):

1. **Sensitivity** (:func:`_measure_sensitivity`): the KLD each layer causes when *only that layer* is stored in a
   candidate spec, on the calibration windows. ``sensitivity="direct"`` measures every (layer, candidate) end to end:
   one engine per pair, whose plan stores that layer in that spec and every other layer in float32. The default,
   ``"proxy"``, measures end to end only each layer's *probe* (its candidate of largest attention error) and
   predicts the others from the attention-output error each causes::

       kld[l][c] = kld_e2e[l][probe] * err[l][c] / err[l][probe]
       err[l][c] = |attn(q, rt_c(k), rt_c(v)) - attn(q, k, v)|^2 / |attn(q, k, v)|^2   (float64, summed over windows)

   where ``q, k, v`` are layer ``l``'s inputs captured from the float32-cache run (model basis) and ``rt_c`` the
   round trip through candidate ``c``'s codec (:meth:`kv8.cache.codec.KVCodec.round_trip`, exactly what the cache
   stores and reads). The per-layer factor ``kld_e2e / err`` carries how much that layer's attention error matters
   to the logits; the ratio assumes it is the same for every candidate (KLD quadratic in a small error).
   Candidates whose format is the float32 reference's own cost 0 (nothing is rounded).
2. **Choice** (:func:`kv8.tools.plan_choice.choose_plan`): the fewest bytes per token within the KLD budget, or the
   least predicted KLD within a bytes budget; the prediction sums the layers' KLDs (additivity for small errors).
3. **Verification** (:func:`search_plan`): the chosen plan, written as a plan file, runs end to end on held-out
   windows (those right after the calibration windows). With a KLD budget, a measurement above it chooses again
   for a predicted KLD of at most ``predicted * budget / measured`` (the prediction corrected by the measured
   ratio, below the rejected plan's, so the plan changes), at most ``retries`` times; the plan is
   returned only once a measurement is within the budget (``ValueError`` otherwise, naming what was measured).

FP8 candidates keep dynamic scales (one per token and head: ``kv_cache_scale_mode="dynamic"``, which a plan file
cannot set per layer, so a plan with FP8 layers is served with ``--kv-cache-scale-mode dynamic``; the written file
says so under ``calibration``). Static scales per layer are not searched.

The written file (:func:`write_plan_file`) names every layer's format and rotation, so it does not depend on the
``kv_cache_dtype`` it is served with, and keeps what was measured under ``calibration`` (read and ignored by the
engine: :func:`kv8.cache.plan.read_plan_file`), the whole sensitivity table included: another budget can be
chosen from it without measuring again (``--plan-table``; the choice is still checked end to end).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kv8.cache.codec import K, KVCodec, V
from kv8.cache.plan import PLAN_VERSION, KVSpec
from kv8.engine.engine import LLMEngine
from kv8.layers.attention import PagedAttention
from kv8.quant.formats import resolve_kv_cache_dtype, resolve_kv_cache_dtypes
from kv8.quant.rotation import canonical_rotation, is_rotated
from kv8.tools.calibrate import build_engine, cache_size_options, check_length, model_arch
from kv8.tools.data import read_corpus, token_windows, tokenize_corpus
from kv8.tools.evaluate import QuantErrorObserver, Scorer, score_window
from kv8.tools.plan_choice import PlanChoice, SensitivityTable, choose_plan
from kv8.validators import check_int

__all__ = ["DEFAULT_PLAN_FORMATS", "PlanSearchResult", "SENSITIVITY_MODES", "attention_error", "attention_parts",
           "causal_attention", "causal_mask", "default_plan_candidates", "parse_plan_formats", "read_sensitivity_table",
           "search_plan", "table_record", "write_plan_file"]

#: the candidates ``kv8 calibrate --plan`` tries by default, widest first (the order breaks ties: plan_choice)
DEFAULT_PLAN_FORMATS = ("bfloat16", "int8_per_token_head+hadamard", "int8_per_token_head", "k8v4+hadamard", "k8v4",
                        "int4_per_token_head+hadamard", "int4_per_token_head")
SENSITIVITY_MODES = ("proxy", "direct")

Progress = Callable[[str], None]


def parse_plan_formats(names: Sequence[str], head_dim: int, compute_dtype: torch.dtype) -> tuple[KVSpec, ...]:
    """Candidates from ``FORMAT[+ROTATION]`` names (``int8+hadamard``, ``bfloat16``, ``k8v4+hadamard``,
    ``fp8/int4_g32+none/hadamard``: keys unrotated, values rotated; every
    ``kv_cache_dtype`` name and alias, K/V pairs included; FP8 formats with dynamic scales). ``ValueError`` for an
    unknown format or rotation, a rotation or a group-scaled format the head size does not allow, a duplicate, or
    none at all."""
    if not names:
        raise ValueError("--plan-formats needs at least one format, e.g. bfloat16 int8+hadamard int4+hadamard")
    specs: list[KVSpec] = []
    for name in names:
        fmt, _, rotation = name.partition("+")
        try:
            rotation = canonical_rotation(rotation or "none", "rotation")
        except ValueError as e:
            raise ValueError(f"--plan-formats {name!r}: {e} (write FORMAT, FORMAT+hadamard or FORMAT+none/hadamard)"
                             ) from None
        try:
            kv_dtype, v_dtype = resolve_kv_cache_dtypes(fmt, compute_dtype)
        except ValueError as e:
            raise ValueError(f"--plan-formats {name!r}: {e}") from None
        if is_rotated(rotation) and head_dim & (head_dim - 1):
            raise ValueError(f"--plan-formats {name!r}: the {rotation} rotation needs a power-of-two head_dim; this "
                             f"model's is {head_dim}")
        for side in (kv_dtype, v_dtype):
            if side.group is not None:
                try:
                    side.group.check_head_dim(head_dim, side.name)
                except ValueError as e:
                    raise ValueError(f"--plan-formats {name!r}: {e}") from None
        spec = KVSpec.of(kv_dtype, rotation, "dynamic", v_dtype)
        if spec in specs:
            raise ValueError(f"--plan-formats names {spec.describe()} twice ({', '.join(names)})")
        specs.append(spec)
    return tuple(specs)


def default_plan_candidates(head_dim: int, compute_dtype: torch.dtype) -> tuple[tuple[KVSpec, ...], tuple[str, ...]]:
    """The candidates of :data:`DEFAULT_PLAN_FORMATS` that a model of this ``head_dim`` allows, and the names of
    those it does not (the rotation needs a power-of-two head_dim, ``k8v4``'s values a multiple of 32). Formats named
    by the user are checked by :func:`parse_plan_formats` and refused instead."""
    kept: list[KVSpec] = []
    dropped: list[str] = []
    for name in DEFAULT_PLAN_FORMATS:
        try:
            kept.extend(parse_plan_formats([name], head_dim, compute_dtype))
        except ValueError:
            dropped.append(name)
    return tuple(kept), tuple(dropped)


def spec_entry(spec: KVSpec) -> dict[str, str]:
    """A plan file's entry for one layer."""
    return {"kv_cache_dtype": spec.name, "kv_cache_rotation": spec.rotation}


def table_record(table: SensitivityTable) -> dict[str, Any]:
    """The sensitivity table as the ``calibration.table`` of a plan file (:func:`read_sensitivity_table`)."""
    return {"candidates": [dict(spec_entry(c), dynamic=c.dynamic) for c in table.candidates],
            "bytes": list(table.bytes), "kld": [list(row) for row in table.kld]}


def read_sensitivity_table(path: str) -> SensitivityTable:
    """The sensitivity table a ``kv8 calibrate --plan`` run recorded in its plan file (``--plan-table``).
    ``ValueError`` naming the file when it has none or it is malformed."""
    where = f"--plan-table {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f).get("calibration", {}).get("table")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: not a plan file written by kv8 calibrate --plan ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} records no sensitivity table (calibration.table); it was not written by kv8 "
                         "calibrate --plan")
    try:
        candidates = tuple(_recorded_spec(c) for c in record["candidates"])
        return SensitivityTable(candidates, tuple(int(b) for b in record["bytes"]),
                                tuple(tuple(float(k) for k in row) for row in record["kld"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: its calibration.table is malformed: {e}") from None


def _recorded_spec(entry: dict[str, Any]) -> KVSpec:
    """A candidate as :func:`table_record` wrote it."""
    k_dtype, v_dtype = resolve_kv_cache_dtypes(entry["kv_cache_dtype"], torch.float32)
    return KVSpec(k_dtype, canonical_rotation(entry["kv_cache_rotation"]), bool(entry["dynamic"]),
                  None if v_dtype == k_dtype else v_dtype)


def write_plan_file(path: str | os.PathLike[str], specs: Sequence[KVSpec],
                    calibration: dict[str, Any] | None = None) -> None:
    """Write a ``kv_cache_plan`` file naming every layer's format and rotation, plus ``calibration`` (what was
    measured; the engine ignores it)."""
    data: dict[str, Any] = {"kv8_kv_plan": PLAN_VERSION,
                            "layers": {str(i): spec_entry(s) for i, s in enumerate(specs)}}
    if calibration is not None:
        data["calibration"] = calibration
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def causal_mask(t: int, window: int | None) -> torch.Tensor:
    """``[T, T]`` bool: query ``i`` sees key ``j`` when ``j <= i`` (and ``j > i - window`` with a sliding window)."""
    pos = torch.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    return mask


def attention_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits ``[Hq, T, T]`` (-inf where ``mask`` is False), weights and output ``[T, Hq, D]`` of one sequence
    (``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, each K/V head shared by ``Hq / Hkv`` query heads)."""
    group = q.shape[1] // k.shape[1]
    kq, vq = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q, kq).mul(scale).masked_fill(~mask, float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    return logits, weights, torch.einsum("hts,shd->thd", weights, vq)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None) -> torch.Tensor:
    """The plain causal attention output ``[T, Hq, D]`` of one sequence (see :func:`attention_parts`), keys older
    than a sliding ``window`` masked."""
    return attention_parts(q, k, v, scale, causal_mask(q.shape[0], window))[2]


def attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                    codec: KVCodec, layer: int) -> tuple[float, float]:
    """``(|out_c - out|^2, |out|^2)`` in float64 for one layer and sequence, K and V round-tripped by ``codec``."""
    def round_trip(x: torch.Tensor, which: int) -> torch.Tensor:
        back, _ = codec.round_trip(codec.to_stored_basis(x.float(), which), layer, which)
        return codec.to_stored_basis(back, which).double()   # the rotation is its own inverse

    out = causal_attention(q.double(), k.double(), v.double(), scale, window)
    out_c = causal_attention(q.double(), round_trip(k, K), round_trip(v, V), scale, window)
    return float((out_c - out).pow(2).sum()), float(out.pow(2).sum())


class _Capture(QuantErrorObserver):
    """Prompt logits (as for ``kv8 eval``) and, while ``keep`` is set, every layer's ``(q, k, v)`` in float32."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.keep = False
        self.steps: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def on_attention_inputs(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            codec: KVCodec) -> None:
        if self.keep:
            self.steps.setdefault(layer, []).append((query.float().clone(), key.float().clone(),
                                                     value.float().clone()))


@dataclass
class _KLDMeter:
    """The float32-cache reference's log-probabilities on fixed windows, and the mean KLD of another engine on them
    (the scored halves, as ``kv8 eval`` scores them)."""

    windows: list[list[int]]
    ref_logp: list[torch.Tensor] = field(default_factory=list)

    @property
    def first(self) -> int:
        return len(self.windows[0]) // 2 - 1

    def reference(self, engine: LLMEngine, obs: _Capture,
                  on_window: Callable[[_Capture], None] | None = None) -> None:
        """Score the reference; ``on_window(obs)`` after each window (with ``obs.keep`` set: its q/k/v)."""
        for w in self.windows:
            obs.keep, obs.steps = on_window is not None, {}
            self.ref_logp.append(score_window(engine, obs, w, self.first))
            obs.keep = False
            if on_window is not None:
                on_window(obs)

    def kld(self, engine: LLMEngine, obs: QuantErrorObserver) -> float:
        scorer = Scorer()
        for w, ref in zip(self.windows, self.ref_logp):
            scorer.add(score_window(engine, obs, w, self.first), ref, torch.tensor(w[self.first + 1:]))
        return max(scorer.kld / scorer.n, 0.0)


@dataclass(frozen=True)
class _Setup:
    """What every engine of one search shares."""

    model: str
    num_layers: int
    common: dict[str, Any]
    one_pool: dict[str, int]    # the cache size of an engine with one pool (the reference) ...
    pools: dict[str, int]       # ... and of one with a plan
    workdir: str

    def engine_for(self, specs: dict[int, KVSpec], obs: QuantErrorObserver) -> LLMEngine:
        """An engine whose plan stores ``specs``' layers as given and every other layer in float32."""
        path = os.path.join(self.workdir, "plan.json")
        full = [specs.get(i, KVSpec.of(resolve_kv_cache_dtype("float32", torch.float32))) for i in
                range(self.num_layers)]
        write_plan_file(path, full)
        dynamic_fp8 = any(s.kv_dtype.is_fp8 for s in specs.values())
        return build_engine(self.model, obs, kv_cache_dtype="float32", kv_cache_plan=path,
                            kv_cache_scale_mode="dynamic" if dynamic_fp8 else "static", **self.pools, **self.common)

    def reference(self, obs: QuantErrorObserver) -> LLMEngine:
        """The same engine with a float32 cache."""
        return build_engine(self.model, obs, kv_cache_dtype="float32", **self.one_pool, **self.common)

    def measure(self, meter: _KLDMeter, specs: dict[int, KVSpec]) -> float:
        obs = QuantErrorObserver(self.num_layers)
        engine = self.engine_for(specs, obs)
        try:
            return meter.kld(engine, obs)
        finally:
            del engine
            gc.collect()


def _is_reference(spec: KVSpec) -> bool:
    return spec.name == "float32" and spec.rotation == "none"


def _measure_sensitivity(setup: _Setup, ref: LLMEngine, obs: _Capture, meter: _KLDMeter,
                         candidates: tuple[KVSpec, ...], sensitivity: str, progress: Progress) -> SensitivityTable:
    """Fill a :class:`SensitivityTable` (see the module docstring): the reference ``ref`` (a float32 cache, watched
    by ``obs``) runs once over ``meter``'s windows (capturing q/k/v for the proxy), then one engine per measured
    (layer, candidate)."""
    arch, layout = ref.config.arch, ref.layout
    assert isinstance(ref.model, torch.nn.Module)   # every CausalLM is one
    scale_of = {m.layer_idx: m.scale for m in ref.model.modules() if isinstance(m, PagedAttention)}
    attn_scales = [scale_of[i] for i in range(arch.num_layers)]
    windows = [layout.groups[layout.layer_group[i]].sliding_window for i in range(arch.num_layers)]
    codecs = [KVCodec.build(s.kv_dtype, arch.head_dim, scale_mode="dynamic" if s.dynamic else "static",
                            rotation=s.rotation, v_dtype=s.v_dtype) for s in candidates]
    err = torch.zeros(arch.num_layers, len(candidates), dtype=torch.float64)
    norm = torch.zeros(arch.num_layers, dtype=torch.float64)

    def accumulate(capture: _Capture) -> None:
        for layer in range(arch.num_layers):
            q, k, v = (torch.cat(parts) for parts in zip(*capture.steps[layer]))   # the prompt's chunks in order
            for c, codec in enumerate(codecs):
                e, n = attention_error(q, k, v, attn_scales[layer], windows[layer], codec, layer)
                err[layer, c] += e
            norm[layer] += n

    progress(f"reference (float32 cache) on {len(meter.windows)} calibration windows of {len(meter.windows[0])} "
             "tokens; attention error of every layer and candidate")
    meter.reference(ref, obs, accumulate if sensitivity == "proxy" else None)
    rel = err / norm.clamp(min=1e-300).unsqueeze(1)
    kld = torch.zeros_like(rel)
    todo = [(layer, c) for layer in range(arch.num_layers) for c in range(len(candidates))
            if not _is_reference(candidates[c]) and (sensitivity == "direct" or c == int(rel[layer].argmax()))]
    for n, (layer, c) in enumerate(todo, 1):
        kld[layer, c] = setup.measure(meter, {layer: candidates[c]})
        error = f" (attention error {rel[layer, c]:.3g})" if sensitivity == "proxy" else ""
        progress(f"[{n}/{len(todo)}] layer {layer}, {candidates[c].describe()}: KLD {kld[layer, c]:.3g}{error}")
    if sensitivity == "proxy":
        for layer in range(arch.num_layers):
            probe = int(rel[layer].argmax())
            factor = kld[layer, probe] / rel[layer, probe] if rel[layer, probe] > 0 else 0.0
            kld[layer] = rel[layer] * factor
    head_dim, kv_heads = arch.head_dim, arch.num_kv_heads
    return SensitivityTable(candidates, tuple(s.token_bytes(head_dim, kv_heads) for s in candidates),
                            tuple(tuple(float(x) for x in row) for row in kld))


@dataclass(frozen=True)
class PlanSearchResult:
    """The plan chosen and verified, with what each attempt predicted and measured."""

    table: SensitivityTable
    choice: PlanChoice
    measured_kld: float
    attempts: tuple[tuple[PlanChoice, float], ...]   # (choice, measured KLD) per verification, in order
    calibration: dict[str, Any]

    @property
    def specs(self) -> tuple[KVSpec, ...]:
        return self.choice.specs(self.table)


def search_plan(model: str, data: Sequence[str], *, kld_budget: float | None = None, bytes_budget: int | None = None,
                formats: Sequence[str] | None = None, sensitivity: str = "proxy", num_samples: int = 2,
                seq_len: int = 256, skip_tokens: int = 0, check_samples: int = 2, retries: int = 2,
                dtype: str = "auto", max_num_batched_tokens: int = 2048, attention_backend: str = "auto",
                table: SensitivityTable | None = None, progress: Progress = print) -> PlanSearchResult:
    """Measure, choose and verify a plan (module docstring). Exactly one of ``kld_budget`` (nats per token) and
    ``bytes_budget`` (bytes per token, all layers). ``formats`` None: :data:`DEFAULT_PLAN_FORMATS`, less those the
    model's head_dim does not allow (a progress line names them). ``ValueError`` for bad options, data or models,
    an impossible budget (naming the best reachable KLD or the fewest bytes), or a plan still above the KLD budget after
    ``retries`` tightenings. A ``table`` (from an earlier search: :func:`read_sensitivity_table`) replaces step 1,
    and its candidates ``formats``; it must fit the model (its layer count and its candidates' bytes per token)."""
    if (kld_budget is None) == (bytes_budget is None):
        raise ValueError("--plan needs exactly one of --kld-budget and --bytes-budget")
    if sensitivity not in SENSITIVITY_MODES:
        raise ValueError(f"--plan-sensitivity {sensitivity!r}: choose one of {', '.join(SENSITIVITY_MODES)}")
    for name, value, low in (("num_samples", num_samples, 1), ("seq_len", seq_len, 4),
                             ("check_samples", check_samples, 1), ("retries", retries, 0)):
        check_int(name, value, low)
    given = table is not None
    docs = read_corpus(data)
    check_length(model, seq_len, "seq_len")
    arch = model_arch(model)
    common = dict(dtype=dtype, enable_prefix_caching=False, max_model_len=seq_len + 1, max_num_seqs=1,
                  max_num_batched_tokens=max(max_num_batched_tokens, seq_len), attention_backend=attention_backend)
    with tempfile.TemporaryDirectory(prefix="kv8-plan-") as workdir:
        setup = _Setup(model, arch.num_layers, common, cache_size_options(arch, seq_len + 1, 16, 1, pools=False),
                       cache_size_options(arch, seq_len + 1, 16, 1, pools=True), workdir)
        obs = _Capture(arch.num_layers)
        ref = setup.reference(obs)
        if table is not None:
            candidates = table.candidates
        elif formats is not None:
            candidates = parse_plan_formats(formats, arch.head_dim, ref.config.dtype)
        else:
            candidates, dropped = default_plan_candidates(arch.head_dim, ref.config.dtype)
            if dropped:
                progress(f"default candidates without {', '.join(dropped)}: head_dim {arch.head_dim} does not allow "
                         "them")
        if table is not None and (table.num_layers != arch.num_layers or table.bytes != tuple(
                c.token_bytes(arch.head_dim, arch.num_kv_heads) for c in candidates)):
            raise ValueError(f"--plan-table: its table has {table.num_layers} layers and candidates of "
                             f"{table.bytes} bytes per token; {model!r} has {arch.num_layers} layers and they would "
                             "take other bytes: a table of another model")
        tokens = tokenize_corpus(docs, ref.tokenizer)
        calib = token_windows(tokens, seq_len, num_samples, skip_tokens, "--seq-len", "--skip-tokens")
        held_out = token_windows(tokens, seq_len, check_samples, skip_tokens + len(calib) * seq_len, "--seq-len",
                                 "--skip-tokens and the --num-samples calibration samples; the plan's check needs "
                                 "text beyond them")
        if table is None:
            table = _measure_sensitivity(setup, ref, obs, _KLDMeter(calib), candidates, sensitivity, progress)
        check = _KLDMeter(held_out)
        check.reference(ref, obs)
        del ref
        gc.collect()
        attempts: list[tuple[PlanChoice, float]] = []
        target = kld_budget
        while True:
            choice = choose_plan(table, kld_budget=target, bytes_budget=bytes_budget)
            measured = setup.measure(check, dict(enumerate(choice.specs(table))))
            attempts.append((choice, measured))
            progress(f"plan: {choice.bytes_per_token} bytes per token, predicted KLD {choice.predicted_kld:.3g}, "
                     f"measured {measured:.3g} on {len(held_out)} held-out windows")
            if kld_budget is None or measured <= kld_budget:
                break
            assert target is not None
            if len(attempts) > retries:
                best = min(attempts, key=lambda a: a[1])
                raise ValueError(
                    f"--kld-budget {kld_budget:.3g}: after {retries} tightenings the plans measured "
                    f"{', '.join(f'{m:.3g}' for _, m in attempts)} (predicted "
                    f"{', '.join(f'{c.predicted_kld:.3g}' for c, _ in attempts)}); the best, {best[1]:.3g} at "
                    f"{best[0].bytes_per_token} bytes per token, is above the budget: raise --kld-budget or "
                    "--plan-retries, or measure on more text (--num-samples)")
            target = choice.predicted_kld * kld_budget / measured   # below this plan's prediction: a new plan
            if target < table.best_kld():
                raise ValueError(
                    f"--kld-budget {kld_budget:.3g} cannot be met: the plan predicted at {choice.predicted_kld:.3g} "
                    f"measured {measured:.3g}, so a plan predicted at most {target:.3g} would be needed, and the "
                    f"least KLD these candidates reach is {table.best_kld():.3g} (predicted: every layer in its most "
                    "accurate candidate); raise the budget or add a wider format to --plan-formats")
            progress(f"measured KLD above the budget {kld_budget:.3g}: choosing again for a predicted KLD <= "
                     f"{target:.3g}")
    fp8 = any(s.kv_dtype.is_fp8 for s in choice.specs(table))
    calibration = {
        "tool": "kv8 calibrate --plan", "model": model, "kld_budget": kld_budget, "bytes_budget": bytes_budget,
        "bytes_per_token": choice.bytes_per_token, "predicted_kld": choice.predicted_kld, "measured_kld": measured,
        "sensitivity": sensitivity if not given else "a table given (--plan-table)",
        "candidates": [s.describe() for s in candidates],
        "calibration_windows": [len(calib), seq_len, skip_tokens],
        "check_windows": [len(held_out), seq_len, skip_tokens + len(calib) * seq_len],
        "kv_cache_scale_mode": "dynamic" if fp8 else "static",
        "layer_kld": [table.kld[i][c] for i, c in enumerate(choice.choice)],
        "table": table_record(table),
    }
    return PlanSearchResult(table, choice, measured, tuple(attempts), calibration)
