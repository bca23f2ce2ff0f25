"""``/metrics`` of a data-parallel endpoint: every replica's Prometheus text, relabelled and merged.

Each replica renders its own :class:`kv8.entrypoints.openai.metrics.ServerMetrics` text. :func:`merge_replica_metrics`
parses them into families (a ``# TYPE`` line starts one; its samples follow) and writes each family once: its
``# HELP`` / ``# TYPE`` lines, then every replica's samples with a ``replica="<index>"`` label, then, for the
families where a sum means something, the sum over replicas with ``replica="all"`` (so a query that sums itself
selects ``replica!="all"``). Not summed: the ratios ``kv8:kv_cache_usage_perc`` and ``kv8:prefix_cache_hit_rate``
(their numerators and denominators are summed: blocks, prefix-cache hits and queries).

Invariant: the output is valid exposition text: one ``# TYPE`` per family, each family's samples contiguous.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

NOT_SUMMED = frozenset({"kv8:kv_cache_usage_perc", "kv8:prefix_cache_hit_rate"})


@dataclass
class _Family:
    header: list[str]                                                  # the "# HELP" and "# TYPE" lines
    samples: list[tuple[str, str, str]] = field(default_factory=list)  # (name, labels without braces, value)


def _parse(text: str, families: dict[str, _Family], replica: str) -> None:
    current: _Family | None = None
    pending_help: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("# HELP "):
            pending_help = [line]
            continue
        if line.startswith("# TYPE "):
            name = line.split()[2]
            current = families.setdefault(name, _Family(pending_help + [line]))
            pending_help = []
            continue
        if line.startswith("#") or current is None:
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        labels = labels.rstrip("}")
        labels = f'replica="{replica}"' + (f",{labels}" if labels else "")
        current.samples.append((name, labels, value))


def _total_key(labels: str) -> str:
    """The labels of a sample without its ``replica`` label (the first one, see :func:`_parse`)."""
    _, _, rest = labels.partition(",")
    return rest if labels.startswith("replica=") else labels


def merge_replica_metrics(texts: Mapping[int, str]) -> str:
    """One exposition text of the replicas' texts (replica index -> its ``/metrics`` text)."""
    families: dict[str, _Family] = {}
    for replica in sorted(texts):
        _parse(texts[replica], families, str(replica))
    lines: list[str] = []
    for name, fam in families.items():
        lines += fam.header
        lines += [f"{n}{{{labels}}} {value}" for n, labels, value in fam.samples]
        if name in NOT_SUMMED or len(texts) < 2:
            continue
        totals: dict[tuple[str, str], float] = {}
        for n, labels, value in fam.samples:
            key = (n, _total_key(labels))
            totals[key] = totals.get(key, 0.0) + float(value)
        for (n, rest), total in totals.items():
            labels = 'replica="all"' + (f",{rest}" if rest else "")
            lines.append(f"{n}{{{labels}}} {int(total) if total.is_integer() else total}")
    return "\n".join(lines) + "\n"


def render_router_metrics(up: Mapping[int, bool], in_flight: Mapping[int, int],
                          routed: Mapping[tuple[int, str], int], failures: Mapping[int, int],
                          rejected: Mapping[int, int]) -> str:
    """The ingress's own families: replicas up, requests in flight and routed per replica (by reason),
    replica failures seen, and requests the ingress answered with an error itself (by HTTP status)."""
    def family(name: str, kind: str, help_: str, samples: list[str]) -> list[str]:
        return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples]

    lines = family("kv8:dp_replica_up", "gauge", "1 while the replica is routed to, 0 while it is down.",
                   [f'kv8:dp_replica_up{{replica="{r}"}} {int(v)}' for r, v in sorted(up.items())])
    lines += family("kv8:dp_replica_requests_in_flight", "gauge", "Requests the router sent to the replica and "
                    "that are not answered yet.",
                    [f'kv8:dp_replica_requests_in_flight{{replica="{r}"}} {v}' for r, v in sorted(in_flight.items())])
    lines += family("kv8:dp_requests_routed_total", "counter", "Requests routed, by replica and reason (prefix: "
                    "the longest cached prefix; least_loaded).",
                    [f'kv8:dp_requests_routed_total{{replica="{r}",reason="{why}"}} {v}'
                     for (r, why), v in sorted(routed.items())])
    lines += family("kv8:dp_replica_failures_total", "counter", "Times a replica was found dead or unreachable.",
                    [f'kv8:dp_replica_failures_total{{replica="{r}"}} {v}' for r, v in sorted(failures.items())])
    lines += family("kv8:dp_ingress_rejected_total", "counter", "Requests the ingress answered with an error "
                    "before routing them (auth, body, no replica up), by HTTP status.",
                    [f'kv8:dp_ingress_rejected_total{{status="{s}"}} {v}' for s, v in sorted(rejected.items())])
    return "\n".join(lines) + "\n"
