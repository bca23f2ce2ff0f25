"""Tensor parallelism's options, declared and validated once: :class:`ParallelConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kv8.options import option
from kv8.validators import check_bool, check_int

__all__ = ["ParallelConfig", "SplitShape"]


class SplitShape(Protocol):
    """What tensor parallelism splits of a model (a :class:`kv8.models.config.ModelArchConfig` has it)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (:mod:`kv8.distributed`): ``tensor_parallel_size`` ranks, each running
    ``cpu_threads_per_rank`` torch threads (None: the machine's cores divided among the ranks; with one rank
    the process's setting is left alone). ``adaptive_cpu_threads``: a one-rank engine gives its parallel regions
    only the cores other processes leave free (:mod:`kv8.engine.threads`); ranks keep their threads.

    Invariants: both are ints >= 1 (or None for the threads); :meth:`check_model` -- called by
    :class:`kv8.engine.config.EngineConfig` -- checks that the model's heads and MLP split over the ranks.
    """

    tensor_parallel_size: int = option(
        1, "ranks (processes) the model is split over, Megatron style; each rank's KV cache holds its KV heads "
        "(kv_cache_memory is per rank). Under torchrun, the world size", type=int)
    cpu_threads_per_rank: int | None = option(
        None, "torch threads of each tensor-parallel rank (default: the cores divided among the ranks)", type=int)
    adaptive_cpu_threads: bool = option(
        True, "give parallel regions only the cores other processes leave free (measured twice a second), so that "
        "kv8's spinning OpenMP threads do not collapse beside other busy work; off: always all threads (one-rank "
        "engines; tensor-parallel ranks keep theirs)", type=bool)

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("cpu_threads_per_rank", self.cpu_threads_per_rank, 1, optional=True)
        check_bool("adaptive_cpu_threads", self.adaptive_cpu_threads)

    def threads(self, cpu_count: int) -> int | None:
        """Torch threads of each rank on a machine of ``cpu_count`` cores (None: leave the setting alone)."""
        if self.cpu_threads_per_rank is not None:
            return self.cpu_threads_per_rank
        return None if self.tensor_parallel_size == 1 else max(1, cpu_count // self.tensor_parallel_size)

    def check_model(self, arch: SplitShape) -> None:
        """``ValueError`` unless the model splits over ``tensor_parallel_size`` ranks: query heads and
        ``intermediate_size`` divisible by it; KV heads divisible by it or (replicated, as vLLM does) dividing
        it."""
        n = self.tensor_parallel_size
        if n == 1:
            return
        if arch.num_heads % n:
            raise ValueError(f"tensor_parallel_size={n} must divide the model's num_attention_heads="
                             f"{arch.num_heads}")
        if arch.num_kv_heads % n and n % arch.num_kv_heads:
            raise ValueError(f"tensor_parallel_size={n} must divide the model's num_key_value_heads="
                             f"{arch.num_kv_heads}, or be a multiple of it (KV heads are then replicated)")
        if arch.intermediate_size % n:
            raise ValueError(f"tensor_parallel_size={n} must divide the model's intermediate_size="
                             f"{arch.intermediate_size}")

    def kv_heads_per_rank(self, arch: SplitShape) -> int:
        """KV heads in each rank's cache (one when they are replicated)."""
        return max(1, arch.num_kv_heads // self.tensor_parallel_size)
