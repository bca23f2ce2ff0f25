"""Choosing a per-layer KV plan from a table of per-layer costs: the pure half of ``kv8 calibrate --plan``.

A :class:`SensitivityTable` holds, for every model layer and every candidate :class:`~kv8.cache.plan.KVSpec`, the
bytes one token of that layer takes in that spec (:meth:`KVSpec.token_bytes`) and the KL divergence the model's
next-token distribution gets when *only that layer* is stored that way (predicted or measured:
:mod:`kv8.tools.plan_search` fills it). :func:`choose_plan` picks one candidate per layer:

* with a KLD budget: the plan of fewest bytes per token whose predicted KLD is at most the budget (among plans of
  those bytes, the one of least KLD);
* with a bytes budget: the plan of least predicted KLD whose bytes per token are at most the budget.

The predicted KLD of a plan is the *sum* of its layers' KLDs. That assumes the layers' errors add: for small,
independent perturbations the KL divergence is a quadratic form of the logit error, and errors of different layers
are uncorrelated, so the cross terms average out. It is a prediction; ``kv8 calibrate --plan`` measures the chosen
plan end to end and tightens the budget when the measurement exceeds it.

The choice is exact, a multiple-choice knapsack solved by dynamic programming over the reachable byte totals: after
each layer only the Pareto front of (bytes, KLD) partial plans is kept (a partial plan with more bytes and no less
KLD than another can never be completed better). Candidates take only a few distinct byte counts, so the front
stays small (at most a few thousand points for 30 layers and 4 distinct sizes).

Ties are broken deterministically: among plans of equal bytes and equal KLD the one whose per-layer candidate indices
come first (lowest index of the first layer that differs, then the next...) wins, so the order of the candidates
is the order of preference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kv8.cache.plan import KVSpec

__all__ = ["PlanChoice", "SensitivityTable", "choose_plan"]


@dataclass(frozen=True)
class SensitivityTable:
    """Per layer and candidate: ``bytes[c]`` per token of one layer, ``kld[layer][c]`` (nats) with only that layer
    in ``candidates[c]``.

    Invariants: at least one candidate and one layer; distinct candidates; byte counts positive integers; every
    KLD finite and >= 0 (a measured KLD that rounds below 0 is clamped by whoever fills the table)."""

    candidates: tuple[KVSpec, ...]
    bytes: tuple[int, ...]
    kld: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"a sensitivity table needs distinct candidates, got {self.candidates}")
        if len(self.bytes) != len(self.candidates) or not all(isinstance(b, int) and b > 0 for b in self.bytes):
            raise ValueError(f"bytes must be one positive integer per candidate, got {self.bytes}")
        if not self.kld:
            raise ValueError("a sensitivity table needs at least one layer")
        for layer, row in enumerate(self.kld):
            if len(row) != len(self.candidates) or not all(math.isfinite(k) and k >= 0 for k in row):
                raise ValueError(f"layer {layer}: needs one finite KLD >= 0 per candidate, got {row}")

    @property
    def num_layers(self) -> int:
        return len(self.kld)

    def best_kld(self) -> float:
        """The least predicted KLD any plan reaches: every layer in its most accurate candidate."""
        return sum(min(row) for row in self.kld)


@dataclass(frozen=True)
class PlanChoice:
    """A candidate index per layer, with the plan's bytes per token and predicted KLD (the sums over layers)."""

    choice: tuple[int, ...]
    bytes_per_token: int
    predicted_kld: float

    def specs(self, table: SensitivityTable) -> tuple[KVSpec, ...]:
        """The spec of every layer."""
        return tuple(table.candidates[c] for c in self.choice)


def _front(table: SensitivityTable) -> list[dict[int, tuple[float, tuple[int, ...]]]]:
    """``fronts[i]``: bytes -> (least KLD, the first choice reaching it) over layers ``0 .. i``, Pareto-pruned."""
    front: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    fronts = []
    for row in table.kld:
        grown: dict[int, tuple[float, tuple[int, ...]]] = {}
        for total, (kld, choice) in sorted(front.items()):
            for c, (b, k) in enumerate(zip(table.bytes, row)):
                key, value = total + b, (kld + k, (*choice, c))
                if key not in grown or value < grown[key]:   # less KLD, then the first choice in index order
                    grown[key] = value
        pruned: dict[int, tuple[float, tuple[int, ...]]] = {}
        best = math.inf
        for total in sorted(grown):
            if grown[total][0] < best:
                pruned[total] = grown[total]
                best = grown[total][0]
        front = pruned
        fronts.append(front)
    return fronts


def choose_plan(table: SensitivityTable, *, kld_budget: float | None = None,
                bytes_budget: int | None = None) -> PlanChoice:
    """The plan of fewest bytes within ``kld_budget``, or of least KLD within ``bytes_budget`` (exactly one of the
    two). ``ValueError`` when no plan meets the budget, naming the best reachable KLD (or the fewest bytes)."""
    if (kld_budget is None) == (bytes_budget is None):
        raise ValueError("choose_plan needs exactly one of kld_budget and bytes_budget")
    front = _front(table)[-1]
    if kld_budget is not None:
        if not (math.isfinite(kld_budget) and kld_budget > 0):
            raise ValueError(f"--kld-budget {kld_budget!r} must be a finite number > 0")
        fits = [t for t, (k, _) in front.items() if k <= kld_budget]
        if not fits:
            raise ValueError(f"--kld-budget {kld_budget:.3g} cannot be met: the least KLD these candidates reach is "
                             f"{table.best_kld():.3g} (every layer in its most accurate candidate); raise the budget "
                             "or add a wider format to --plan-formats")
        total = min(fits)
    else:
        assert bytes_budget is not None
        fits = [t for t in front if t <= bytes_budget]
        if not fits:
            raise ValueError(f"--bytes-budget {bytes_budget} cannot be met: the fewest bytes per token these "
                             f"candidates reach is {min(front)} (every layer in its narrowest candidate); raise the "
                             "budget or add a narrower format to --plan-formats")
        total = min(fits, key=lambda t: (front[t][0], t))
    kld, choice = front[total]
    return PlanChoice(choice, total, kld)
