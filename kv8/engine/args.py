"""User-facing engine options with vLLM's names, turned into a validated :class:`EngineConfig`.

``LLM(**kwargs)``, the CLI and the server all go through :class:`EngineArgs`, so every entry point accepts
the same options with the same checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from kv8.config import (CacheConfig, EngineConfig, ModelArchConfig, SchedulerConfig, blocks_for_memory,
                        default_kv_cache_memory, format_bytes, parse_memory, resolve_dtype)
from kv8.quant.formats import resolve_kv_cache_dtype

logger = logging.getLogger("kv8")

DEFAULT_MODEL = "smollm2-135m"


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization_param_path: str | None = None
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    dense_backend: str = "auto"
    kv_cache_scale_mode: str = "static"
    kv_cache_rotation: str = "none"

    @staticmethod
    def field_names() -> list[str]:
        return [f.name for f in fields(EngineArgs)]

    def create_engine_config(self, hf_config: dict, model_kind: str, model_path: str) -> EngineConfig:
        """Validate everything against the model's architecture."""
        arch = ModelArchConfig.from_hf_config(hf_config)
        dtype = resolve_dtype(self.dtype)
        kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")
        memory = None if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory)
        cache = CacheConfig(kv_dtype=kv_dtype, block_size=self.block_size, kv_cache_memory=memory,
                            num_kv_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
                            quantization_param_path=self.quantization_param_path,
                            scale_mode=self.kv_cache_scale_mode, rotation=self.kv_cache_rotation)
        if cache.rotation == "hadamard" and arch.head_dim & (arch.head_dim - 1):
            raise ValueError(f"kv_cache_rotation='hadamard' needs a power-of-two head_dim; this model has "
                             f"head_dim={arch.head_dim}")
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(arch.max_position_embeddings, 8192)
            if arch.sliding_window:
                max_model_len = min(max_model_len, arch.sliding_window)
        elif arch.sliding_window and max_model_len > arch.sliding_window:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's sliding window "
                             f"({arch.sliding_window}); kv8 does not implement sliding-window attention")
        sched = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                max_model_len=max_model_len)
        return EngineConfig(model=model_path, model_kind=model_kind, arch=arch, dtype=dtype, cache=cache,
                            scheduler=sched, seed=self.seed, attention_backend=self.attention_backend,
                            dense_backend=self.dense_backend)


def resolve_num_blocks(config: EngineConfig) -> int:
    """Blocks for the configured budget; raises if they cannot hold one ``max_model_len`` sequence."""
    cc, arch = config.cache, config.arch
    if cc.num_kv_blocks is not None:
        num_blocks = cc.num_kv_blocks
    else:
        memory = cc.kv_cache_memory if cc.kv_cache_memory is not None else default_kv_cache_memory()
        num_blocks = blocks_for_memory(memory, arch, cc.kv_dtype, cc.block_size, cc.dynamic_scales)
    capacity = num_blocks * cc.block_size
    if capacity < config.scheduler.max_model_len:
        per_token = arch.kv_bytes_per_token(cc.kv_dtype, cc.dynamic_scales)
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {cc.block_size}, "
            f"{format_bytes(per_token)} per token in {cc.kv_dtype.name}), fewer than max_model_len="
            f"{config.scheduler.max_model_len}; raise kv_cache_memory (needs at least "
            f"{format_bytes(per_token * config.scheduler.max_model_len)}) or lower max_model_len")
    return num_blocks


__all__ = ["DEFAULT_MODEL", "EngineArgs", "resolve_num_blocks"]
