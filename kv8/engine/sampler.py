"""Turn one step's logits into next tokens, per-request reproducibly.

``sample(logits, params, generators, histories)`` handles a batch in which every row has its own
``SamplingParams`` and its own ``torch.Generator`` (on the engine's device: :func:`make_generator`):

* First, rows that use them get ``logit_bias`` added and then the repetition, frequency and presence penalties
  (vLLM's semantics, see :func:`apply_penalties`), computed from that row's :class:`TokenHistory`. Rows without
  them are not touched, so with every one off the logits (and any seeded draw) are bit-identical.

* Greedy rows (``temperature < 1e-5``): ``argmax`` of the raw logits; ties go to the lowest token id.
  Their generator is not touched. The argmax is ``torch.argmax`` (:func:`argmax_reference`) or kv8's AVX-512 /
  AVX2 kernel with the same result on rows without NaN (:meth:`kv8.kernels.cpu.dense.DenseKernels.argmax`, ~8x
  faster on a 49k vocabulary), chosen once by :func:`select_argmax` and passed to :func:`sample`.
* Random rows, in this order: divide by the temperature, keep the ``top_k`` most likely tokens, keep
  the smallest prefix (by probability) whose mass is >= ``top_p`` (the top token is always kept),
  drop tokens whose probability is below ``min_p`` times the top probability (each filter sees the
  distribution renormalised after the previous one). Then draw with the exponential race
  ``argmax(p / q)``, ``q ~ Exp(1)``, written in log space as ``argmax(logit - log q)`` (the Gumbel-max
  trick), where ``q`` is a fresh length-V draw from that row's generator only.

Reproducibility invariant: every random row draws exactly V exponentials from its own generator per
call, and all other arithmetic is row-wise, so a seeded request produces the same tokens whatever
the other rows of the batch are and wherever it sits in the batch. The noise is drawn on the generator's
device: the CPU's generator (Mersenne Twister) and a CUDA generator (Philox) give different streams for one
seed, so a seed reproduces its tokens on one kind of device, not across the CPU and CUDA. The filters are
batched and run on each row's best candidates (partial selection, :func:`_apply_filters`; the
full-vocabulary sort :func:`apply_filters_reference` is their oracle and fallback); only the noise is drawn
row by row.

Logprobs follow vLLM v1's default: they are taken from ``log_softmax`` of the raw logits (before
temperature and filtering), computed in float32.

No host sync (CUDA): nothing in :func:`sample` reads a device tensor on the host when the platform says such a
read waits for the device (:attr:`kv8.platform.Platform.host_reads_sync`); per-row parameters go to the device
by copies that do not wait (:meth:`kv8.platform.Platform.to_device`), and the one place where the CPU path
decides from values (a top-p / min-p row whose candidates do not close) sends those rows to the full sort
instead. The runner reads the results back once per step.

Validation: ``sample`` runs every step, so it trusts its per-row inputs: each ``SamplingParams`` was
validated at construction and each request's ``logprobs`` checked against the vocabulary where the request
entered the engine (:mod:`kv8.engine.input_processor`). It only checks the batch's shape and that every row of
logits has a finite maximum, its contract (a NaN from the model must not become a token): the runner takes a
request whose row has none out of the batch first and fails it alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kv8.kernels.cpu.build import KernelUnavailable
from kv8.kernels.cpu.dense import load_dense_kernels
from kv8.platform import CPU, Platform
from kv8.sampling_params import SamplingParams, SamplingType
from kv8.validators import check_int

__all__ = ["CANDIDATES", "Argmax", "SamplerOutput", "TokenHistory", "apply_filters_reference", "apply_penalties",
           "argmax_reference", "compute_logprobs", "make_generator", "sample", "select_argmax"]

logger = logging.getLogger("kv8")

#: ``argmax(x [B, V] float32) -> [B] int64``: the lowest index of each row's maximum (rows without NaN).
Argmax = Callable[[torch.Tensor], torch.Tensor]


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)``: the oracle of the kernel and the fallback where it is unavailable."""
    return torch.argmax(x, dim=-1)


def select_argmax(platform: Platform = CPU) -> Argmax:
    """On the CPU kv8's argmax kernel where the dense kernels build and load (AVX-512 BF16 or AVX2), else (and on
    every other platform) :func:`argmax_reference`."""
    if platform.kind != "cpu":
        return argmax_reference
    try:
        return load_dense_kernels().argmax
    except KernelUnavailable as exc:
        logger.debug("sampler: torch.argmax, kv8's kernels are unavailable: %s", str(exc))
        return argmax_reference


# Exponential draws are clamped to this so that ``log q`` is finite: a filtered token (logit -inf)
# then stays at -inf and can never win the race.
_TINY = torch.finfo(torch.float32).tiny
# Candidates per row for top-p / min-p without top_k: the nucleus of a sampling distribution almost always
# closes within them; a row whose does not is filtered by the full sort.
CANDIDATES = 1024


@dataclass(frozen=True)
class SamplerOutput:
    """Result of one sampling step for a batch of B rows.

    token_ids: [B] int64, the chosen token of each row.
    logprobs: [B] float32, log-probability of each chosen token under the raw distribution
        (``log_softmax`` of the raw logits); None when no row has ``logprobs`` set.
    top_logprobs: (values [B, K] float32, ids [B, K] int64), each row sorted by decreasing value,
        with K the largest ``logprobs`` requested in the batch (rows that asked for fewer use the
        first entries; rows that asked for none may ignore theirs); None when no row has
        ``logprobs`` set.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a row's penalties are computed from: its prompt's and what it generated so far (read only)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def make_generator(seed: int | None, fallback: torch.Generator,
                   device: torch.device | str = "cpu") -> torch.Generator:
    """Return a new generator on ``device`` (the engine's: noise is drawn where the logits are) for one request.

    With a seed the generator is ``manual_seed(seed)``; with ``None`` its seed is drawn from
    ``fallback`` (the engine's CPU generator, itself seeded by the engine-level seed), which advances
    ``fallback``. Either way the result is a deterministic function of (seed, fallback state, device type).
    """
    if not isinstance(fallback, torch.Generator) or fallback.device.type != "cpu":
        raise ValueError(f"fallback must be a CPU torch.Generator, got {fallback!r}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=fallback).item())
    else:
        check_int("seed", seed, -(2**63), 2**64 - 1)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int, *, ids_checked: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``token_ids`` and the top ``k`` of each row, from raw logits.

    Args:
        logits: [N, V] floating point, converted to float32.
        token_ids: [N] integer ids in [0, V).
        k: number of top entries, 0 <= k <= V.
        ids_checked: the ids are known to lie in [0, V) (the sampler's own), so they are not read back to check.

    Returns:
        (token_logprob [N] float32, topk values [N, k] float32 sorted descending, topk ids [N, k]
        int64). The same function serves prompt logprobs (N = prompt positions).
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a 2-D floating point tensor [N, V], got shape {tuple(logits.shape)} "
            f"dtype {logits.dtype}"
        )
    n_rows, vocab = logits.shape
    if token_ids.shape != (n_rows,) or token_ids.is_floating_point() or token_ids.dtype == torch.bool:
        raise ValueError(
            f"token_ids must be an integer tensor of shape ({n_rows},), got shape "
            f"{tuple(token_ids.shape)} dtype {token_ids.dtype}"
        )
    check_int("k", k, 0, vocab)
    ids = token_ids.to(device=logits.device, dtype=torch.int64)
    if n_rows and not ids_checked and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token_ids must lie in [0, {vocab}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, V]
    token_logprob = logp.gather(1, ids.unsqueeze(1)).squeeze(1)  # [N]
    top_values, top_ids = torch.topk(logp, k, dim=-1, largest=True, sorted=True)  # [N, k] x2
    return token_logprob, top_values, top_ids


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    histories: Sequence[TokenHistory | None] | None = None,
    *,
    finite_checked: bool = False,
    argmax: Argmax = argmax_reference,
    platform: Platform = CPU,
) -> SamplerOutput:
    """Choose one token per row; see the module docstring for the algorithm and invariants.

    Args:
        logits: [B, V] any floating dtype; computed in float32. Every row must have a finite
            maximum (no NaN, no +inf, not all -inf); -inf entries are allowed and never sampled.
        params: B validated SamplingParams, one per row, each with ``logprobs`` None or <= V and
            ``logit_bias`` ids < V.
        generators: B generators, one per row (greedy rows' generators are left untouched); the noise is drawn on
            each one's device.
        histories: B entries, one per row: the row's tokens where its params use penalties
            (``SamplingParams.uses_penalties``), anything (None) elsewhere; may be None when no row uses them.
        finite_checked: the caller checks itself which rows have a finite maximum (the engine's runner does, to
            fail such a request alone): this ``[B, V]`` reduction is not run, and a row without one gets an
            arbitrary token id in ``[0, V)`` (and logprobs) that the caller drops.
        argmax: the row argmax (see :data:`Argmax`; the engine passes :func:`select_argmax`'s choice).
        platform: where ``logits`` live; with :attr:`~kv8.platform.Platform.host_reads_sync` nothing is read back
            (module docstring).
    """
    _check_inputs(logits, params, generators, finite_checked)
    raw = logits.detach().to(torch.float32)  # [B, V]; never modified in place (logprobs read it)
    x = apply_penalties(raw, params, histories, platform)
    n_rows = x.shape[0]

    greedy = [i for i, p in enumerate(params) if p.sampling_type is SamplingType.GREEDY]
    random_rows = [i for i, p in enumerate(params) if p.sampling_type is SamplingType.RANDOM]
    if len(greedy) == n_rows:   # the common batch: no row gather, no copy
        token_ids = argmax(x)
    else:
        token_ids = torch.empty(n_rows, dtype=torch.int64, device=x.device)
    if greedy and len(greedy) < n_rows:
        # the first maximal index: ties go to the lowest id
        rows = platform.to_device(greedy, torch.int64, x.device)
        token_ids[rows] = argmax(x[rows])
    if random_rows:
        sub = x if len(random_rows) == n_rows else x[platform.to_device(random_rows, torch.int64, x.device)]
        drawn = _sample_random(sub, [params[i] for i in random_rows], [generators[i] for i in random_rows], argmax,
                               platform)
        if len(random_rows) == n_rows:
            token_ids = drawn
        else:
            token_ids[platform.to_device(random_rows, torch.int64, x.device)] = drawn

    requested = [p.logprobs for p in params if p.logprobs is not None]
    if not requested:
        return SamplerOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)
    token_logprob, top_values, top_ids = compute_logprobs(raw, token_ids, max(requested), ids_checked=True)
    return SamplerOutput(
        token_ids=token_ids, logprobs=token_logprob, top_logprobs=(top_values, top_ids)
    )


def apply_penalties(x: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[TokenHistory | None] | None, platform: Platform = CPU) -> torch.Tensor:
    """``x [B, V]`` float32 with each row's ``logit_bias`` added, then its penalties applied (vLLM's order and
    semantics)::

        x[t] += logit_bias[t]
        if t in prompt or output:  x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        x[t] -= frequency_penalty * count_output(t) + presence_penalty * (count_output(t) > 0)

    Batched over the rows that use them; the others are returned bit-identical (``x`` itself when no row uses
    any). A repetition penalty close to 0 could overflow a logit to +inf: results are clamped to float32's
    largest finite value, -inf (a masked token) stays -inf. Everything built on the host goes to the device by
    copies that do not wait (``platform``).
    """
    n_rows, vocab = x.shape
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    pen_rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not bias_rows and not pen_rows:
        return x
    out = x.clone()
    device = x.device
    if bias_rows:
        rows = [i for i in bias_rows for _ in params[i].logit_bias or {}]
        cols = [t for i in bias_rows for t in params[i].logit_bias or {}]
        vals = [b for i in bias_rows for b in (params[i].logit_bias or {}).values()]
        out.index_put_((platform.to_device(rows, torch.int64, device), platform.to_device(cols, torch.int64, device)),
                       platform.to_device(vals, torch.float32, device), accumulate=True)
    if pen_rows:
        if histories is None or any(histories[i] is None for i in pen_rows):
            raise ValueError("histories must hold a TokenHistory for every row whose params use penalties")
        hist = [histories[i] for i in pen_rows]
        n_pen = len(pen_rows)

        def counts(lists: list[Sequence[int]]) -> torch.Tensor:  # [P, V] float32 occurrences of each token
            row = torch.repeat_interleave(torch.arange(n_pen), torch.tensor([len(ids) for ids in lists]))
            ids = torch.tensor([t for ids in lists for t in ids], dtype=torch.int64)
            c = torch.zeros(n_pen, vocab, dtype=torch.float32)
            c.index_put_((row, ids), torch.ones(len(ids), dtype=torch.float32), accumulate=True)
            return (c.pin_memory() if platform.pinned_memory else c).to(device, non_blocking=True)

        output_counts = counts([h.output_token_ids for h in hist if h is not None])        # [P, V]
        seen = (counts([h.prompt_token_ids for h in hist if h is not None]) > 0) | (output_counts > 0)
        sel = platform.to_device(pen_rows, torch.int64, device)
        sub = out[sel]                                                                        # [P, V]
        ps = [params[i] for i in pen_rows]
        # [3, P, 1]: repetition, frequency, presence penalty of each row, in one copy
        rep, freq, pres = platform.to_device([[p.repetition_penalty for p in ps], [p.frequency_penalty for p in ps],
                                              [p.presence_penalty for p in ps]], torch.float32, device).unsqueeze(2)
        rep = torch.where(seen, rep, torch.ones_like(sub))                                    # [P, V]
        sub = torch.where(sub > 0, sub / rep, sub * rep)
        sub = sub - freq * output_counts - pres * (output_counts > 0).to(torch.float32)
        out[sel] = sub.clamp(max=torch.finfo(torch.float32).max)
    return out


def _check_inputs(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
    finite_checked: bool = False,
) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            "logits must be a 2-D floating point tensor [B, V], got "
            f"{type(logits).__name__} {getattr(logits, 'shape', None)} {getattr(logits, 'dtype', None)}"
        )
    n_rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError(f"logits must have a vocabulary dimension >= 1, got shape {tuple(logits.shape)}")
    if len(params) != n_rows:
        raise ValueError(f"params must have one entry per logits row ({n_rows}), got {len(params)}")
    if len(generators) != n_rows:
        raise ValueError(
            f"generators must have one entry per logits row ({n_rows}), got {len(generators)}"
        )
    if n_rows and not finite_checked:
        row_max = logits.detach().amax(dim=-1)  # [B]; amax propagates NaN
        bad = (~torch.isfinite(row_max)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"logits rows {bad} have no finite maximum (NaN, +inf or all -inf); every row needs "
                "at least one finite logit and no NaN or +inf"
            )


def _sample_random(
    x: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator], argmax: Argmax,
    platform: Platform = CPU,
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the exponential race; x is [R, V] float32."""
    n_rows, vocab = x.shape
    temperature = platform.to_device([p.temperature for p in params], torch.float32, x.device)
    # Subtracting the row max first keeps a small temperature from overflowing to inf.
    scaled = (x - x.amax(dim=-1, keepdim=True)) / temperature.unsqueeze(1)  # [R, V], max 0
    filtered = _apply_filters(scaled, params, platform)

    # Row by row, each from its own generator, on that generator's device (the engine's: no copy): the only place
    # where rows are not batched.
    noise = torch.stack(
        [torch.empty(vocab, dtype=torch.float32, device=g.device).exponential_(generator=g) for g in generators]
    ).to(x.device)  # [R, V]
    noise.clamp_(min=_TINY)
    return argmax(filtered - noise.log())


def _apply_filters(scaled: torch.Tensor, params: Sequence[SamplingParams], platform: Platform = CPU) -> torch.Tensor:
    """:func:`apply_filters_reference` by partial selection: the filters only ever keep the most likely
    tokens, so they run on the ``K`` best of each row (``torch.topk``, ordered as the stable sort orders them)
    instead of a sort of the whole vocabulary. A row's own bound is its ``top_k``, or :data:`CANDIDATES` when
    only top-p / min-p filter it; a row whose bound is half the vocabulary or more, or whose filters could keep
    a token beyond its candidates (the nucleus does not close within them, or the last candidate still passes
    min-p), is filtered by the reference, row by row, so which path a row takes depends on that row alone.
    Where reading a device tensor waits for the device (``platform.host_reads_sync``: CUDA), whether the
    candidates closed is not read back: a row bounded by :data:`CANDIDATES` alone goes to the reference at once
    (the same tokens, a full sort on the GPU instead of a wait).
    The tokens kept equal the reference's, with two exceptions at a cut: which of several exactly equal logits
    straddling the ``K``-th place enter the candidates follows ``topk``, and a probability within float
    rounding of a top-p or min-p threshold may fall on the other side (the sums run over ``K`` values).
    """
    n_rows, vocab = scaled.shape
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    active = [k < vocab or tp < 1.0 or mp > 0.0 for k, tp, mp in zip(top_k, top_p, min_p)]
    if not any(active):
        return scaled
    bound = [k if k < vocab else min(vocab, CANDIDATES) for k in top_k]
    # a row bounded by its own top_k always closes within its candidates; the others only maybe
    fast = [i for i in range(n_rows) if active[i] and bound[i] < vocab // 2
            and (top_k[i] < vocab or not platform.host_reads_sync)]
    chosen = set(fast)
    slow = [i for i in range(n_rows) if active[i] and i not in chosen]
    out = scaled.clone()
    device = scaled.device
    if fast:
        fast_t = platform.to_device(fast, torch.int64, device)
        filtered, closed = _filter_candidates(scaled[fast_t], [top_k[i] for i in fast], [top_p[i] for i in fast],
                                              [min_p[i] for i in fast], max(bound[i] for i in fast), platform)
        out[fast_t] = filtered
        if any(top_k[i] == vocab for i in fast):   # the CPU only (above): reading `closed` costs nothing there
            slow += [fast[j] for j, ok in enumerate(closed.tolist()) if not ok]
    if slow:
        slow_t = platform.to_device(slow, torch.int64, device)
        out[slow_t] = apply_filters_reference(scaled[slow_t], [params[i] for i in slow], platform)
    return out


def _filter_candidates(scaled: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float],
                       k_cand: int, platform: Platform = CPU) -> tuple[torch.Tensor, torch.Tensor]:
    """The filters on the ``k_cand`` best of each row of ``scaled [R, V]``: (filtered ``[R, V]``, closed
    ``[R]`` bool: True where no token beyond the candidates could have been kept, so the row is exact)."""
    vocab = scaled.shape[1]
    device = scaled.device
    values, ids = torch.topk(scaled, k_cand, dim=-1)                                  # [R, K], descending
    by_id = torch.argsort(ids, dim=-1)                 # equal values: increasing id, as the stable sort has them
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    cand, cand_ids = values.gather(1, order), ids.gather(1, order)                   # [R, K]
    position = torch.arange(k_cand, device=device).unsqueeze(0)
    keep = position < platform.to_device(top_k, torch.int64, device).unsqueeze(1)    # [R, K]
    neg_inf = float("-inf")
    closed = platform.to_device([k < vocab for k in top_k], torch.bool, device)   # top_k already bounds the row
    if any(tp < 1.0 for tp in top_p):
        # Probabilities over what top_k kept: the candidates when top_k bounds the row, else the whole row.
        log_norm = torch.where(closed, torch.logsumexp(cand.masked_fill(~keep, neg_inf), dim=-1),
                               torch.logsumexp(scaled, dim=-1))                      # [R]
        probs = torch.exp(cand.masked_fill(~keep, neg_inf) - log_norm.unsqueeze(1))  # [R, K]
        mass = torch.cumsum(probs, dim=-1)
        mass_before = torch.zeros_like(probs)
        mass_before[:, 1:] = mass[:, :-1]
        top_p_t = platform.to_device(top_p, torch.float32, device).unsqueeze(1)
        keep &= (mass_before < top_p_t) | (top_p_t >= 1.0)
        closed |= ((mass[:, -1:] >= top_p_t) & (top_p_t < 1.0)).squeeze(1)
    if any(mp > 0.0 for mp in min_p):
        # min_p compares each probability with the largest, a ratio no renormalisation changes.
        ratio = torch.exp(cand - cand[:, :1])                                          # [R, K]
        min_p_t = platform.to_device(min_p, torch.float32, device).unsqueeze(1)
        keep &= ratio >= min_p_t
        closed |= (ratio[:, -1:] < min_p_t).squeeze(1)
    filtered = torch.full_like(scaled, neg_inf).scatter_(1, cand_ids, cand.masked_fill(~keep, neg_inf))
    return filtered, closed


def apply_filters_reference(scaled: torch.Tensor, params: Sequence[SamplingParams],
                            platform: Platform = CPU) -> torch.Tensor:
    """Set to -inf the logits removed by top_k, then top_p, then min_p; scaled is [R, V]. The plain
    reference: one stable sort of the whole vocabulary per row (what :func:`_apply_filters` must equal).

    A row whose filters are all disabled comes back bit-identical, so whether a batch needs the
    sort at all does not change any row's result.
    """
    n_rows, vocab = scaled.shape
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    use_top_p = any(v < 1.0 for v in top_p)
    use_min_p = any(v > 0.0 for v in min_p)
    if all(k == vocab for k in top_k) and not use_top_p and not use_min_p:
        return scaled

    device = scaled.device
    # Stable descending sort: equal logits keep increasing-id order, so results are deterministic.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [R, V] x2
    position = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V]
    keep = position < platform.to_device(top_k, torch.int64, device).unsqueeze(1)  # [R, V]
    neg_inf = float("-inf")

    if use_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, neg_inf), dim=-1)  # [R, V]
        # Mass strictly before each position; position 0 has 0 < top_p, so the top token stays.
        mass_before = torch.zeros_like(probs)
        mass_before[:, 1:] = torch.cumsum(probs, dim=-1)[:, :-1]
        top_p_t = platform.to_device(top_p, torch.float32, device).unsqueeze(1)  # [R, 1]
        keep &= (mass_before < top_p_t) | (top_p_t >= 1.0)
    if use_min_p:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, neg_inf), dim=-1)  # [R, V]
        min_p_t = platform.to_device(min_p, torch.float32, device).unsqueeze(1)  # [R, 1]
        keep &= probs >= min_p_t * probs[:, :1]

    kept_sorted = sorted_logits.masked_fill(~keep, neg_inf)
    return torch.full_like(scaled, neg_inf).scatter_(1, order, kept_sorted)  # back to vocab order
