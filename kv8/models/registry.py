"""Which model class runs a checkpoint: Hugging Face ``model_type`` (or ``architectures``) -> class.

Adding an architecture is one model file in :mod:`kv8.models`, one entry in :data:`MODEL_TYPES` (and its
``architectures`` names in :data:`ARCHITECTURES`), and tests. A model class follows :class:`CausalLM`.
``model_type`` decides when present; ``architectures`` is consulted only for a config without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import torch

from kv8.layers.attention import AttentionContext
from kv8.layers.dense_backend import DenseBackend
from kv8.models.config import ModelArchConfig
from kv8.models.gemma3 import Gemma3ForCausalLM
from kv8.models.llama import LlamaForCausalLM
from kv8.models.phi3 import Phi3ForCausalLM
from kv8.models.qwen3 import Qwen3ForCausalLM

__all__ = ["ARCHITECTURES", "MODEL_TYPES", "CausalLM", "arch_config", "arch_config_class", "model_class",
           "resolve_model_type", "supported_model_types"]


class CausalLM(Protocol):
    """What the loader and the runner use of a model class."""

    # checkpoint module name -> (merged module name, shard id), for merged linear layers
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | str]]]
    # parameter name -> name of the parameter it shares when ``arch.tie_word_embeddings``
    tied_weights: ClassVar[dict[str, str]]
    # the config class :func:`arch_config` builds for this model (a subclass adds fields)
    arch_config_cls: ClassVar[type[ModelArchConfig]]

    def __init__(self, arch: ModelArchConfig, backend: DenseBackend) -> None:
        """Build on the current default device (the loader uses the meta device)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """``forward``: token ids and positions ``[T]`` -> final hidden states ``[T, E]``."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` -> float32 logits ``[N, V]``."""


MODEL_TYPES: dict[str, Any] = {   # model_type -> a class following CausalLM
    "gemma3_text": Gemma3ForCausalLM,   # GGUF architecture "gemma3" is read as this type (kv8.loader.gguf)
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

ARCHITECTURES: dict[str, str] = {
    "Gemma3ForCausalLM": "gemma3_text",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(MODEL_TYPES))


def resolve_model_type(hf_config: Mapping[str, Any]) -> str:
    """The supported ``model_type`` of a Hugging Face config dict (from ``architectures`` when the config has
    no ``model_type``); ``ValueError`` naming the type and the supported ones."""
    model_type = hf_config.get("model_type")
    if model_type is None:
        for name in hf_config.get("architectures") or ():
            if name in ARCHITECTURES:
                model_type = ARCHITECTURES[name]
                break
    if isinstance(model_type, str) and model_type in MODEL_TYPES:
        return model_type
    given = (f"model_type={model_type!r}" if model_type is not None
             else f"a config without model_type (architectures={hf_config.get('architectures')!r})")
    raise ValueError(f"{given} is not supported; kv8 supports model types: {', '.join(supported_model_types())} "
                     f"(architectures: {', '.join(sorted(ARCHITECTURES))})")


def arch_config_class(model_type: str) -> type[ModelArchConfig]:
    """The config class of a registered ``model_type`` (its model's ``arch_config_cls``)."""
    cls: type[ModelArchConfig] = MODEL_TYPES[model_type].arch_config_cls
    return cls


def arch_config(hf_config: Mapping[str, Any]) -> ModelArchConfig:
    """The architecture of a Hugging Face config dict, in its model's config class; ``ValueError`` naming the
    model type, a missing key or a bad value."""
    if not isinstance(hf_config, Mapping):
        raise ValueError(f"the model config must be a JSON object, got {type(hf_config).__name__}")
    model_type = resolve_model_type(hf_config)
    return arch_config_class(model_type).from_hf_config(hf_config, model_type)


def model_class(hf_config: Mapping[str, Any]) -> type:
    """The class for a Hugging Face config dict; ``ValueError`` naming the type and the supported ones."""
    return MODEL_TYPES[resolve_model_type(hf_config)]
