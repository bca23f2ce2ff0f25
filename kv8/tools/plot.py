"""``kv8 eval --plot``: one PNG with per-layer scales, per-layer round-trip error and the metrics per config.

Needs matplotlib (``pip install kv8[tools]``); a missing matplotlib raises ValueError with that command.
"""

from __future__ import annotations

import math
from typing import Any

from kv8.tools.evaluate import EvalReport


def _error_axis(ax: Any, values: list[float]) -> None:
    """A log y axis with labelled ticks over the errors (symlog, linear below the smallest non-zero error, when a
    configuration has none: a 16-bit cache's round trip can be exact). A symlog axis whose data lie within a
    decade of its linear threshold gets no major ticks by default, hence the explicit locator and formatter."""
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator, SymmetricalLogLocator

    positive = [v for v in values if v > 0]
    lo = min(positive, default=1e-4)
    if positive and len(positive) == len(values):
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        linthresh = 10 ** math.floor(math.log10(lo))
        ax.set_yscale("symlog", linthresh=linthresh)
        ax.yaxis.set_major_locator(SymmetricalLogLocator(base=10, linthresh=linthresh, subs=(1.0, 2.0, 5.0)))
        ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False))


def plot_report(report: EvalReport, path: str) -> None:
    """Write :func:`make_figure` of ``report`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = make_figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_figure(report: EvalReport) -> Any:
    """A 2 x 2 matplotlib figure: largest K/V scale per layer (fp8 configs), relative RMS round-trip error per
    layer (K solid, V dashed), mean KLD per config, top-1 agreement and ΔPPL per config."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib; install it with: pip install 'kv8[tools]'") from None
    configs = report.results
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    for i, r in enumerate(configs):
        if r.layer_k_scale_max is None or r.layer_v_scale_max is None:
            continue
        color = f"C{i}"
        ax.plot(r.layer_k_scale_max, color=color, marker="o", ms=3, label=f"{r.label} K")
        ax.plot(r.layer_v_scale_max, color=color, ls="--", marker="x", ms=3, label=f"{r.label} V")
    ax.set(title="KV scale per layer (largest in the layer)", xlabel="layer", ylabel="scale", yscale="log")
    if ax.get_legend_handles_labels()[0]:   # no fp8 configuration: no scales to show
        ax.legend(fontsize=7)
    ax = axes[0][1]
    for i, r in enumerate(configs):
        color = f"C{i}"
        ax.plot(r.layer_k_rel_err, color=color, marker="o", ms=3, label=f"{r.label} K")
        ax.plot(r.layer_v_rel_err, color=color, ls="--", marker="x", ms=3, label=f"{r.label} V")
    ax.set(title="cache round-trip error per layer (relative RMS)", xlabel="layer", ylabel="relative RMS error")
    _error_axis(ax, [e for r in configs for e in (*r.layer_k_rel_err, *r.layer_v_rel_err)])
    ax.legend(fontsize=7)
    labels = [r.label for r in configs]
    x = list(range(len(configs)))
    ax = axes[1][0]
    ax.bar(x, [r.mean_kld for r in configs], color=[f"C{i}" for i in x])
    ax.set(title="mean KL divergence vs float32 cache (nats/token)", ylabel="KLD")
    ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    ax = axes[1][1]
    ax.bar(x, [1.0 - r.top1_agreement for r in configs], color=[f"C{i}" for i in x], label="top-1 disagreement")
    ax.set(title="top-1 disagreement and ΔPPL vs float32 cache", ylabel="1 - top-1 agreement")
    ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    twin = ax.twinx()
    twin.plot(x, [r.delta_ppl for r in configs], "ko-", label="ΔPPL")
    twin.set_ylabel("ΔPPL")
    fig.suptitle(f"{report.model}: {report.num_windows} windows x {report.window} tokens "
                 f"({report.scored_tokens} scored), compute {report.dtype}")
    fig.tight_layout()
    return fig
