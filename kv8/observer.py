"""What tools may watch while the engine runs, through one explicit interface.

``kv8 calibrate`` needs every K/V the cache stores, ``kv8 eval`` needs the round-trip error of those values and
the full next-token distribution of every prompt position, and ``scripts/attention_error.py`` every layer's
queries beside its K/V. An :class:`EngineObserver` passed to the engine (``LLMEngine(args, observer=...)``) is
called at exactly those points; the default methods do nothing. Observers must not modify the tensors they are
shown.
"""

from __future__ import annotations

import collections

import torch

from kv8.cache.codec import KVCodec


class EngineObserver:
    """Base class: override the hooks you need."""

    def on_kv_store(self, layer: int, key: torch.Tensor, value: torch.Tensor, codec: KVCodec) -> None:
        """Called once per layer and step, just before new K/V ``[T, H_kv, D]`` (in the codec's stored basis,
        in the compute dtype; the keys centered and scaled when the codec has key offsets and factors,
        :meth:`KVCodec.keys_to_stored`) are encoded into the cache by ``codec``."""

    def on_attention_inputs(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            codec: KVCodec) -> None:
        """Called with :meth:`on_kv_store`, before it: the step's queries ``[T, H_q, D]`` and new K/V ``[T, H_kv, D]``
        of ``layer`` in the model's basis (before the codec's rotation), in the compute dtype."""

    def on_first_keys(self, layer: int, keys: torch.Tensor) -> None:
        """Called after :meth:`on_attention_inputs` when this step holds the first token (position 0) of some
        sequences: their keys ``[N, H_kv, D]`` of ``layer``, in the model's basis (as that hook shows them)."""

    def on_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
        """Called for requests that asked for prompt logprobs: float32 ``logits [rows, V]`` whose row ``i``
        predicts prompt token ``start + i + 1``."""


class AttentionCapture(EngineObserver):
    """Every layer's queries, keys and values of each step, in float64 and the model's basis (``steps[layer]``: one
    ``(q, k, v)`` per step, in order): what ``scripts/attention_error.py`` and ``scripts/kv4_error.py`` quantize
    and attend with offline."""

    def __init__(self) -> None:
        self.steps: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = collections.defaultdict(list)

    def on_attention_inputs(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            codec: KVCodec) -> None:
        self.steps[layer].append((query.double(), key.double(), value.double()))


__all__ = ["AttentionCapture", "EngineObserver"]
