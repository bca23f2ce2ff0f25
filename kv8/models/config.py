"""A decoder's architecture, normalised from a Hugging Face ``config.json`` (or the same dict built from GGUF
metadata): :class:`ModelArchConfig` (and the subclasses model files declare for their own settings), with its
:class:`kv8.layers.rotary.RopeScaling`.

Which class a config dict becomes is decided by model type in :func:`kv8.models.registry.arch_config`;
:meth:`ModelArchConfig.from_hf_config` reads a dict into one given class. Missing keys and values of the wrong
type or range raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv8.layers.rotary import RopeScaling
from kv8.validators import cfg_float, cfg_int, is_int

__all__ = ["LAYER_TYPES", "ModelArchConfig"]


LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture of a decoder, the fields every model and the engine use.

    A model file whose architecture has more settings (Gemma 3's ``query_pre_attn_scalar``, ...) declares a
    subclass with those fields and names it in its class's ``arch_config_cls``; :meth:`from_hf_config` builds
    that subclass, adding the fields its :meth:`extra_fields` reads.

    Attention kinds per layer: ``layer_types[i]`` is ``"sliding_attention"`` (the layer attends to its last
    ``sliding_window`` tokens) or ``"full_attention"``. Invariants: ``num_heads % num_kv_heads == 0``;
    ``head_dim`` even; ``layer_types`` has ``num_layers`` entries from :data:`LAYER_TYPES`, and a sliding one
    only with ``sliding_window`` set.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # the config's attn_logit_softcapping (Gemma 2's cap * tanh(score / cap)); no model kv8 runs applies it (Gemma
    # 3's config refuses it), but what a config says about its scores decides whether key centering is exact
    attn_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size),
                            ("intermediate_size", self.intermediate_size), ("num_hidden_layers", self.num_layers),
                            ("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                            ("head_dim", self.head_dim), ("max_position_embeddings", self.max_position_embeddings),
                            *((("sliding_window", self.sliding_window),) if self.sliding_window is not None else ())):
            if not is_int(value) or value < 1:
                raise ValueError(f"model config {name}={value!r} must be an int >= 1")
        for name, fvalue in (("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta)):
            if not math.isfinite(fvalue) or fvalue <= 0:
                raise ValueError(f"model config {name}={fvalue!r} must be a finite number > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"model config layer_types={list(self.layer_types)!r} must list one of "
                             f"{', '.join(LAYER_TYPES)} for each of the {self.num_layers} layers")
        if self.sliding_window is None and "sliding_attention" in self.layer_types:
            raise ValueError("model config layer_types has sliding_attention layers but no sliding_window")

    @property
    def shift_invariant_scores(self) -> bool:
        """Adding one constant to every attention score of a query leaves the attention output unchanged (a plain
        softmax over the scores): what key centering (:mod:`kv8.quant.key_offsets`) needs. False with logit
        soft-capping; an architecture with attention sinks (a fixed logit every score competes with) must say
        False too."""
        return self.attn_logit_softcapping is None

    @property
    def score_transform(self) -> str:
        """What this architecture does to attention scores besides softmax, in words (for errors)."""
        if self.attn_logit_softcapping is not None:
            return f"soft-caps its attention scores (attn_logit_softcapping={self.attn_logit_softcapping:g})"
        return "passes its scores to a plain softmax"

    def layer_type(self, layer: int) -> str:
        """``layer_types[layer]``; an empty ``layer_types`` means every layer is of the model's one kind
        (sliding when the model has a ``sliding_window``), without a tuple of ``num_layers`` entries."""
        if self.layer_types:
            return self.layer_types[layer]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def has_layer_type(self, kind: str) -> bool:
        return kind in self.layer_types if self.layer_types else self.layer_type(0) == kind

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: the layer attends to the whole context)."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's window (a tuple of ``num_layers``: call it once the layer count is checked against the
        checkpoint)."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @classmethod
    def extra_fields(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The values of the fields a subclass adds, read from the Hugging Face config (none here). A subclass
        may also return base fields its config spells differently (Gemma 3's per-layer-type ``rope_parameters``);
        those replace the generic reading."""
        return {}

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (all of them here; Phi-3's config can rotate fewer)."""
        return self.head_dim

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], model_type: str) -> ModelArchConfig:
        """Read a Hugging Face config.json dict of ``model_type`` into this class (a model's own subclass adds
        the fields :meth:`extra_fields` reads). A missing key, or a value of the wrong type or range, raises
        ``ValueError`` naming the key."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"the model config must be a JSON object, got {type(cfg).__name__}")
        hidden, heads = cfg_int(cfg, "hidden_size"), cfg_int(cfg, "num_attention_heads")
        eos = cfg.get("eos_token_id")
        eos_list = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        if not all(is_int(e) for e in eos_list):
            raise ValueError(f"model config eos_token_id={eos!r} must be an int or a list of ints")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        rope_default = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        layer_types = cfg.get("layer_types")
        if layer_types is not None and not (isinstance(layer_types, list)
                                            and all(isinstance(t, str) for t in layer_types)):
            raise ValueError(f"model config layer_types={layer_types!r} must be a list of strings")
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=cfg_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=cfg_int(cfg, "intermediate_size"),
            num_layers=cfg_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg_int(cfg, "num_key_value_heads", heads),
            head_dim=cfg_int(cfg, "head_dim", hidden // heads if heads > 0 else 0),
            rms_norm_eps=cfg_float(cfg, "rms_norm_eps", 1e-6),
            rope_theta=cfg_float(cfg, "rope_theta", rope_default),
            rope_scaling=RopeScaling.from_hf_config(cfg),
            max_position_embeddings=cfg_int(cfg, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos_list),
            sliding_window=cfg_int(cfg, "sliding_window") if sliding else None,
            layer_types=tuple(layer_types or ()) if sliding else (),
            attn_logit_softcapping=cfg_float(cfg, "attn_logit_softcapping", 0.0)
            if cfg.get("attn_logit_softcapping") is not None else None,
        )
        fields.update(cls.extra_fields(cfg))   # a subclass's own fields, and base fields it reads its way
        return cls(**fields)
