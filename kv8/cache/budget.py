"""KV-cache sizing in one place: bytes per token and per block, blocks for a budget, what fits.

:class:`KVBudget` answers every sizing question for one tensor-parallel rank: the engine and its workers (blocks
per pool, the free-memory check), ``kv8 info`` (the capacity table), and the tools that size their own cache
(:func:`blocks_to_hold`). Nothing else computes bytes per token.

Units::

    token bytes   one token of one layer: K and V of the rank's KV heads, codes plus per-token scales, in the
                  layer's spec (format, scales: :class:`kv8.cache.plan.KVPlan`); the same for every layer of a pool
    bytes/token   the sum over the model's layers of their token bytes (a plan mixes formats)
    block bytes   one block of a pool: num_slots layers x block_size tokens x token bytes
    budget        bytes (kv_cache_memory, or the default) or blocks (num_kv_blocks)

The default budget depends on the device. On the CPU: 25% of the memory free, at most 4 GiB
(:func:`default_kv_cache_memory`). On a GPU, vLLM's ``gpu_memory_utilization`` (:func:`gpu_kv_cache_memory`)::

    kv budget = gpu_memory_utilization x total      what the engine may use of the GPU
              - (total - free)                      in use before the engine loads: CUDA context, other processes
              - weights - activations               this rank's share (DeviceReserve, estimated from the model)

vLLM measures the weights and a profile run's peak once they are loaded; kv8 sizes the cache before it loads (every
tensor-parallel rank gets the same blocks), so the two come from the architecture (:mod:`kv8.engine.memory`) and
:meth:`KVBudget.check_fits_memory` checks the cache against the memory free once the weights are in.

Invariant: ``num_blocks()`` gives each pool at least the blocks one ``max_model_len`` sequence needs in it, or
raises ``ValueError`` naming the option that set the budget; with several pools (a plan, skipped layers) the
budget is split between them by what one ``max_model_len`` sequence needs in each (:meth:`KVBudget.split`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv8.cache.config import CacheConfig
from kv8.cache.layout import KVCacheLayout
from kv8.cache.plan import KVPlan
from kv8.platform import CPU, Platform
from kv8.validators import format_bytes

__all__ = ["DEFAULT_MAX_MODEL_LEN", "NO_RESERVE", "DeviceReserve", "KVBudget", "blocks_to_hold",
           "default_kv_cache_memory", "default_max_model_len", "gpu_kv_cache_memory"]

#: the context length an engine gets when ``max_model_len`` is not given: the model's, at most this
DEFAULT_MAX_MODEL_LEN = 8192


def default_max_model_len(max_position_embeddings: int) -> int:
    """The context length of an engine without ``max_model_len``: the model's, at most :data:`DEFAULT_MAX_MODEL_LEN`."""
    return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def default_kv_cache_memory(platform: Platform = CPU) -> int:
    """The default budget: 25% of the memory free on ``platform`` (:meth:`kv8.platform.Platform.memory_available`;
    8 GiB assumed where it cannot be read), at most 4 GiB (vLLM's CPU default)."""
    available = platform.memory_available()
    return int(min(4 * 1024**3, 0.25 * (available if available is not None else 8 * 1024**3)))


@dataclass(frozen=True)
class DeviceReserve:
    """What one rank takes on its GPU besides the KV cache, in bytes: its share of the model's weights, and the
    activations of its largest step."""

    weights: int
    activations: int


#: the CPU's reserve: its default budget does not count the weights and activations
NO_RESERVE = DeviceReserve(0, 0)


def gpu_kv_cache_memory(platform: Platform, utilization: float, reserve: DeviceReserve) -> int:
    """The default budget on a GPU (vLLM's ``gpu_memory_utilization``): ``utilization x total``, less what is in use
    on the device now (``total - free``) and ``reserve``. ``ValueError`` naming ``gpu_memory_utilization`` and each
    part when nothing is left."""
    free, total = platform.gpu_memory_info()
    allowed, in_use = int(utilization * total), total - free
    budget = allowed - in_use - reserve.weights - reserve.activations
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} lets the engine use {format_bytes(allowed)} of the GPU's "
            f"{format_bytes(total)}, but {format_bytes(in_use)} is in use already, the weights take "
            f"{format_bytes(reserve.weights)} and the activations {format_bytes(reserve.activations)}: nothing is "
            f"left for the KV cache; raise gpu_memory_utilization (at most 1), free the GPU, or set kv_cache_memory")
    return budget


def blocks_to_hold(layer_windows: Sequence[int | None], num_tokens: int, block_size: int, num_seqs: int) -> int:
    """Blocks of a one-pool cache that hold ``num_seqs`` sequences of ``num_tokens`` tokens whole in every group
    (sliding-window groups at full length): what ``kv8 calibrate`` and ``kv8 eval`` give their engines."""
    layout = KVCacheLayout.build(layer_windows, hybrid=False)
    return layout.blocks_per_sequence(0, num_tokens, block_size, num_tokens) * num_seqs


@dataclass(frozen=True)
class KVBudget:
    """The sizes of one rank's KV cache. Build it with :meth:`build`; the engine's comes from
    :meth:`kv8.engine.config.EngineConfig.kv_budget`.

    ``plan``: each layer's spec (pool ``p`` stores spec ``plan.specs[layout.pools[p].spec]``); ``token_bytes[p]``:
    bytes of one token of one layer in pool ``p``; ``chunk``: the most tokens one prefill step stores for a sequence
    (sliding-window groups free blocks before the window of a chunk's first token).
    """

    cache: CacheConfig
    plan: KVPlan
    layout: KVCacheLayout
    token_bytes: tuple[int, ...]
    max_model_len: int
    chunk: int
    platform: Platform = CPU
    reserve: DeviceReserve = NO_RESERVE   # on a GPU: what the weights and activations take

    @classmethod
    def build(cls, cache: CacheConfig, layer_windows: Sequence[int | None], *, head_dim: int, kv_heads: int,
              max_model_len: int, max_num_batched_tokens: int, plan: KVPlan | None = None,
              platform: Platform = CPU, reserve: DeviceReserve = NO_RESERVE) -> KVBudget:
        """The budget of a cache with these options for a model of these layers, each stored as ``plan`` says
        (None: every layer in ``cache.default_spec``), ``kv_heads`` KV heads of ``head_dim`` on this rank;
        ``reserve``: what the rank's weights and activations take on a GPU (the default budget there leaves it
        out)."""
        plan = plan or KVPlan.build(cache.default_spec, len(layer_windows))
        if plan.num_layers != len(layer_windows):
            raise ValueError(f"a KV plan of {plan.num_layers} layers for a model of {len(layer_windows)}")
        layout = KVCacheLayout.build(layer_windows, plan.layer_spec, cache.hybrid)
        token_bytes = tuple(plan.specs[p.spec].token_bytes(head_dim, kv_heads) for p in layout.pools)
        return cls(cache, plan, layout, token_bytes, max_model_len, min(max_num_batched_tokens, max_model_len),
                   platform, reserve)

    @property
    def block_bytes(self) -> tuple[int, ...]:
        """Bytes of one block of each pool (all its slots, K and V, per-token scales included)."""
        return tuple(p.num_slots * self.token_bytes[p.pool_id] * self.cache.block_size for p in self.layout.pools)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in every layer together, each layer in its own spec (sliding-window layers counted
        as if they kept it)."""
        return sum(self.token_bytes[p.pool_id] * len(p.layers) for p in self.layout.pools)

    def blocks_per_sequence(self) -> list[int]:
        """Blocks of each pool one ``max_model_len`` sequence holds at most (out-of-window blocks freed unless the
        cache keeps them)."""
        return [self.layout.blocks_per_sequence(p.pool_id, self.max_model_len, self.cache.block_size, self.chunk)
                for p in self.layout.pools]

    def memory(self) -> int:
        """The budget in bytes: ``kv_cache_memory``, else the device's default (:func:`gpu_kv_cache_memory` on
        CUDA, :func:`default_kv_cache_memory` on the CPU)."""
        cc = self.cache
        if cc.kv_cache_memory is not None:
            return cc.kv_cache_memory
        if self.platform.kind == "cuda":
            return gpu_kv_cache_memory(self.platform, cc.gpu_memory_utilization, self.reserve)
        return default_kv_cache_memory(self.platform)

    def split(self, memory: int) -> list[int]:
        """Blocks per pool for ``memory`` bytes: one pool takes everything; several share it in proportion to what
        one ``max_model_len`` sequence needs in each, so all run out at about the same load."""
        need = [n * b for n, b in zip(self.blocks_per_sequence(), self.block_bytes)]
        return [int(memory * need[p] / sum(need)) // self.block_bytes[p] for p in range(len(need))]

    def num_blocks(self) -> list[int]:
        """Blocks of each pool for the configured budget. ``ValueError`` naming the option that set it when a pool
        cannot hold one ``max_model_len`` sequence. (Whether they fit in free memory: :meth:`check_fits_memory`.)"""
        cc, block_bytes, needs = self.cache, self.block_bytes, self.blocks_per_sequence()
        if cc.num_kv_blocks is not None:
            if len(self.layout.pools) > 1:
                raise ValueError(f"num_kv_blocks cannot size a cache with layers in {len(self.layout.pools)} pools of "
                                 "different formats (kv_cache_dtype_skip_layers or kv_cache_plan); give "
                                 "kv_cache_memory instead")
            num_blocks = [cc.num_kv_blocks]
            fix = f"raise num_kv_blocks to at least {needs[0]}, or lower max_model_len"
        else:
            num_blocks = self.split(self.memory())
            least = format_bytes(sum(b * k for b, k in zip(block_bytes, needs)))
            which = ("gpu_memory_utilization or set kv_cache_memory" if cc.kv_cache_memory is None
                     and self.platform.kind == "cuda" else "kv_cache_memory")
            fix = f"raise {which} (the cache needs at least {least}) or lower max_model_len"
        for p, n, need in zip(self.layout.pools, num_blocks, needs):
            if n < need:
                stored = self.plan.specs[p.spec].describe()
                raise ValueError(
                    f"the KV cache of {self._budget_option(sum(num_blocks))} has {n} blocks of {cc.block_size} "
                    f"tokens ({format_bytes(block_bytes[p.pool_id])} each in {stored}), fewer than max_model_len="
                    f"{self.max_model_len} needs ({need} blocks for one sequence); {fix}")
        return num_blocks

    def pool_rows(self) -> list[tuple[str, tuple[int, ...], int]]:
        """Per pool: its spec described, its layers, and the bytes one token takes in all of them."""
        return [(self.plan.specs[p.spec].describe(), p.layers, self.token_bytes[p.pool_id] * len(p.layers))
                for p in self.layout.pools]

    def check_fits_memory(self, num_blocks: Sequence[int]) -> None:
        """``ValueError`` naming the option that sized the cache when ``num_blocks[p]`` blocks of each pool need
        more memory than is free now. The engine calls it with the weights loaded, before allocating the cache."""
        need = sum(n * b for n, b in zip(num_blocks, self.block_bytes))
        free = self.platform.memory_available()
        where = "this machine" if self.platform.kind == "cpu" else f"the {self.platform.kind} device"
        if free is not None and need > free:
            raise ValueError(
                f"{self._budget_option(sum(num_blocks))} asks for a KV cache of {format_bytes(need)}, but only "
                f"{format_bytes(free)} of memory is free on {where} (the model's weights loaded); lower it")

    def _budget_option(self, num_blocks: int) -> str:
        cc = self.cache
        if cc.num_kv_blocks is not None:
            return f"num_kv_blocks={num_blocks} (--num-kv-blocks)"
        if cc.kv_cache_memory is not None:
            return f"kv_cache_memory={format_bytes(cc.kv_cache_memory)} (--kv-cache-memory)"
        if self.platform.kind == "cuda":
            return (f"gpu_memory_utilization={cc.gpu_memory_utilization} (--gpu-memory-utilization: "
                    f"{format_bytes(self.memory())} for the KV cache)")
        return f"the default kv_cache_memory ({format_bytes(default_kv_cache_memory(self.platform))})"
