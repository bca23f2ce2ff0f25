"""Phi-3 (and Phi-3.5-mini, Phi-4-mini): the Llama-family decoder with a fused checkpoint, LongRoPE and partial
rotary.

The math per layer is :mod:`kv8.models.llama`'s (pre-norm RMSNorm, q/k/v -> RoPE -> paged attention -> o_proj,
SiLU(gate) * up -> down_proj, no biases), and its blocks are reused. What differs:

* The checkpoint already stores the merged matrices ``self_attn.qkv_proj.weight`` (rows ``[q | k | v]``) and
  ``mlp.gate_up_proj.weight`` (rows ``[gate | up]``), in kv8's layout: they load whole into
  :class:`~kv8.layers.linear.QKVLinear` / :class:`~kv8.layers.linear.GateUpLinear` (no
  ``packed_modules_mapping``; the loader checks each shape).
* RoPE scaling ``longrope`` (``short_factor`` / ``long_factor``, see :mod:`kv8.layers.rotary` for kv8's rule of
  which positions use which) and ``partial_rotary_factor`` (rotary over the first
  ``int(head_dim * partial_rotary_factor)`` dims of each head), both read by :class:`Phi3ArchConfig`.
* ``sliding_window`` (Phi-3-mini-4k: 2047): every layer is a sliding-window layer
  (:attr:`ModelArchConfig.layer_types`); the window reaches attention through the engine's attention
  metadata -- the model only names each layer by index.

The model class is the Llama one: :class:`~kv8.models.llama.LlamaModel` builds its rotary embedding over
``arch.rotary_dim``, which :class:`Phi3ArchConfig` derives from ``partial_rotary_factor``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv8.models.config import ModelArchConfig
from kv8.models.llama import LlamaForCausalLM
from kv8.validators import check_number

__all__ = ["Phi3ArchConfig", "Phi3ForCausalLM"]


@dataclass(frozen=True)
class Phi3ArchConfig(ModelArchConfig):
    """Phi-3's config: :class:`ModelArchConfig` plus ``partial_rotary_factor`` in (0, 1].

    Invariants: ``rotary_dim = int(head_dim * partial_rotary_factor)`` is even and >= 2; longrope factor lists
    have ``rotary_dim / 2`` entries; no attention biases (Phi-3 has none).
    """

    partial_rotary_factor: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.partial_rotary_factor
        check_number("model config partial_rotary_factor", f, 0, 1, exclusive_minimum=True)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"model config partial_rotary_factor={f!r} rotates int(head_dim * factor) = "
                             f"{self.rotary_dim} dims of head_dim={self.head_dim}; kv8 needs an even number >= 2")
        if self.attention_bias:
            raise ValueError("model config attention_bias=True is not supported for phi3: Phi-3 checkpoints have no "
                             "q/k/v biases")
        if self.rope_scaling is not None:
            self.rope_scaling.check_rotary_dim(self.rotary_dim)

    @classmethod
    def extra_fields(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model config hidden_act={act!r} is not supported for phi3; kv8 implements silu")
        rope_params = cfg.get("rope_parameters")
        factor = cfg.get("partial_rotary_factor")
        if factor is None and isinstance(rope_params, Mapping):   # transformers 5 keeps it in rope_parameters
            factor = rope_params.get("partial_rotary_factor")
        return {"partial_rotary_factor": 1.0 if factor is None else factor}


class Phi3ForCausalLM(LlamaForCausalLM):
    """The Llama family's model (its rotary embedding over ``arch.rotary_dim``) with Phi-3's checkpoint names."""

    # the checkpoint's qkv_proj and gate_up_proj are kv8's merged layers as they are
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {}
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}   # Phi-4-mini ties them
    arch_config_cls = Phi3ArchConfig
