"""What an engine reports about itself: :class:`EngineStats`, a snapshot taken by :meth:`LLMEngine.stats`.

The servers' ``/metrics``, the benchmarks and the tools read these fields, never the scheduler's or the cache
manager's own state. A snapshot is a value: it does not change when the engine steps on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """One engine's state between two steps. Invariants: ``0 <= num_free_blocks <= num_blocks``;
    ``num_prefilling <= num_running``; ``prefix_cache_hits <= prefix_cache_queries``; the counters
    (``prefix_cache_*``, ``num_preemptions``) never decrease."""

    num_running: int              # sequences in the running batch
    num_waiting: int              # sequences waiting to be admitted (new, or preempted)
    num_prefilling: int           # running sequences with more than one token left to compute (a prompt, or a
    #                               preempted sequence being recomputed): they have not reached decoding yet
    kv_cache_usage: float         # fraction of the KV blocks in use
    num_free_blocks: int
    num_blocks: int
    block_size: int               # tokens per block
    prefix_cache_hit_rate: float  # prefix_cache_hits / prefix_cache_queries (0.0 before any query)
    prefix_cache_hits: int        # blocks served from the prefix cache
    prefix_cache_queries: int     # blocks looked up in it
    num_preemptions: int
    last_step_prefill_tokens: int   # tokens the last step computed in chunks of more than one token
    last_step_decode_tokens: int    # sequences the last step computed one token of (decoding)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds when full."""
        return self.num_blocks * self.block_size
