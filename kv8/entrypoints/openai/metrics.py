"""Server metrics in the Prometheus text exposition format (version 0.0.4), without extra dependencies.

Gauges are read from the engine's stats snapshot at scrape time; counters and histograms are updated by the
request handlers, which all run on the event loop thread (so no locking is needed). Token counters grow as
tokens are produced (prompt tokens when a request is admitted), aborted requests included.
"""

from __future__ import annotations

import bisect

from kv8.engine.stats import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)


class Histogram:
    """Cumulative-bucket histogram; ``buckets`` are the finite upper bounds, ascending."""

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        if list(buckets) != sorted(buckets) or len(set(buckets)) != len(buckets):
            raise ValueError(f"histogram {name}: buckets must be strictly ascending, got {buckets}")
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class ServerMetrics:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.requests_rejected: dict[int, int] = {}
        self.client_disconnects: dict[str, int] = {}   # stage ("upload", "waiting") -> count
        self.ttft = Histogram("kv8:time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS)
        self.tpot = Histogram("kv8:time_per_output_token_seconds", "Mean time per output token after the first.",
                              TPOT_BUCKETS)

    def record_finished(self, finish_reason: str) -> None:
        """One sequence finished ("stop", "length" or "abort")."""
        self.requests_finished[finish_reason] = self.requests_finished.get(finish_reason, 0) + 1

    def record_rejected(self, status: int) -> None:
        self.requests_rejected[status] = self.requests_rejected.get(status, 0) + 1

    def record_disconnect(self, stage: str) -> None:
        """A client went away before its answer: during the body ``upload``, or ``waiting`` for a non-streamed
        answer (streams that end early count as aborted sequences)."""
        self.client_disconnects[stage] = self.client_disconnects.get(stage, 0) + 1

    def render(self, stats: EngineStats, in_flight: int) -> str:
        def gauge(name: str, help_: str, value: float) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]

        def counter(name: str, help_: str, values: dict[str, float]) -> list[str]:
            lines = [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
            lines += [f"{name}{labels} {v}" for labels, v in values.items()]
            return lines

        lines: list[str] = []
        lines += gauge("kv8:kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0 to 1).",
                       stats.kv_cache_usage)
        lines += gauge("kv8:kv_cache_free_blocks", "Free KV cache blocks (cached prefix blocks count as free).",
                       stats.num_free_blocks)
        lines += gauge("kv8:kv_cache_total_blocks", "KV cache blocks in all.", stats.num_blocks)
        lines += gauge("kv8:num_requests_running", "Sequences in the running batch.", stats.num_running)
        lines += gauge("kv8:num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting)
        lines += gauge("kv8:num_requests_in_flight", "Sequences accepted by the server and not finished.", in_flight)
        lines += gauge("kv8:prefix_cache_hit_rate", "Prefix cache hits / queries, in blocks.",
                       stats.prefix_cache_hit_rate)
        lines += counter("kv8:prefix_cache_queries_total", "Prompt blocks looked up in the prefix cache.",
                         {"": stats.prefix_cache_queries})
        lines += counter("kv8:prefix_cache_hits_total", "Prompt blocks served from the prefix cache.",
                         {"": stats.prefix_cache_hits})
        lines += counter("kv8:num_preemptions_total", "Preemptions so far.", {"": stats.num_preemptions})
        lines += counter("kv8:prompt_tokens_total", "Prompt tokens of admitted requests.", {"": self.prompt_tokens})
        lines += counter("kv8:generation_tokens_total", "Tokens generated, aborted requests included.",
                         {"": self.generation_tokens})
        lines += counter("kv8:request_success_total", "Finished sequences by finish reason.",
                         {f'{{finished_reason="{k}"}}': v for k, v in sorted(self.requests_finished.items())})
        lines += counter("kv8:request_rejected_total", "Requests answered with an error, by HTTP status.",
                         {f'{{status="{k}"}}': v for k, v in sorted(self.requests_rejected.items())})
        lines += counter("kv8:client_disconnects_total", "Clients that went away before their answer, by stage "
                         "(upload: during the request body; waiting: before a non-streamed answer).",
                         {f'{{stage="{k}"}}': v for k, v in sorted(self.client_disconnects.items())})
        lines += self.ttft.render()
        lines += self.tpot.render()
        return "\n".join(lines) + "\n"
