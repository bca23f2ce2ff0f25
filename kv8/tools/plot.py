"""``kv8 eval --plot``: one PNG with per-layer scales, per-layer round-trip error and the metrics per config.

Needs matplotlib (``pip install kv8[tools]``); a missing matplotlib raises ValueError with that command.
"""

from __future__ import annotations

from kv8.tools.evaluate import EvalReport


def plot_report(report: EvalReport, path: str) -> None:
    """Write a 2 x 2 figure to ``path``: largest K/V scale per layer (fp8 configs), relative RMS round-trip
    error per layer (K solid, V dashed), mean KLD per config, top-1 agreement and ΔPPL per config."""
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
    ax.legend(fontsize=7)
    ax = axes[0][1]
    for i, r in enumerate(configs):
        color = f"C{i}"
        ax.plot(r.layer_k_rel_err, color=color, marker="o", ms=3, label=f"{r.label} K")
        ax.plot(r.layer_v_rel_err, color=color, ls="--", marker="x", ms=3, label=f"{r.label} V")
    ax.set(title="cache round-trip error per layer (relative RMS)", xlabel="layer", ylabel="relative RMS error")
    ax.set_yscale("symlog", linthresh=1e-4)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
