"""Gemma 3, text decoder (Hugging Face ``Gemma3ForCausalLM``, ``model_type: gemma3_text``) over a paged KV cache.

What differs from :mod:`kv8.models.llama`:

* two kinds of layers, ``arch.layer_types[i]``: ``sliding_attention`` (local: attends to the last
  ``sliding_window`` tokens) and ``full_attention`` (global), each with its own RoPE -- local layers use
  ``rope_local_base_freq`` without scaling, global ones ``rope_theta`` with ``rope_scaling``. The model computes
  both angle sets once per forward and gives each layer its own. Windows are not the model's business: every
  layer passes its ``layer_idx`` to :class:`PagedAttention` and the engine's attention metadata says which
  tokens each layer may read;
* QK-norm: q and k are RMS-normalised per head over ``head_dim`` before RoPE; the attention scale is
  ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``);
* every norm is :class:`GemmaRMSNorm` (``1 + weight``, the multiply in float32; see :mod:`kv8.layers.norm`),
  and a layer has four: input, post-attention, pre-feedforward and post-feedforward. The attention and MLP
  outputs are normalised before they are added to the residual stream;
* GeGLU: ``gelu_tanh(gate) * up`` (:class:`GeluAndMul`);
* the embedding is multiplied by ``sqrt(hidden_size)`` rounded to the compute dtype, as transformers does; the
  output projection is tied to the (unscaled) embedding.

Config features kv8 does not implement (logit soft-capping, bidirectional attention, another activation, RoPE
scaling on local layers, scaling types :class:`kv8.models.config.RopeScaling` lacks) raise ``ValueError`` naming them
when the config is read (:meth:`Gemma3ArchConfig.extra_fields`).

Dense backends: the linear layers use the backend given (packed bf16 kernels or torch); the norms, GeGLU and
the RoPE of the normalised q/k run in torch on every backend (kv8's packed kernels implement the Llama
variants of those ops).

Shapes: ``T`` tokens, ``Hq``/``Hkv`` heads, ``D`` head dim, ``E`` hidden size, ``I`` intermediate size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kv8.distributed.shard import local_head_counts
from kv8.layers.activation import GeluAndMul
from kv8.layers.attention import AttentionContext, PagedAttention
from kv8.layers.dense_backend import TORCH_BACKEND, DenseBackend
from kv8.layers.linear import GateUpLinear, QKVLinear, RowParallelLinear
from kv8.layers.norm import GemmaRMSNorm, norm_per_head
from kv8.layers.rotary import RopeAngles, RopeScaling, RotaryEmbedding
from kv8.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from kv8.models.config import ModelArchConfig
from kv8.models.llama import LlamaForCausalLM
from kv8.validators import cfg_float, cfg_int

__all__ = ["Gemma3ArchConfig", "Gemma3ForCausalLM"]

_ACTIVATIONS = ("gelu_pytorch_tanh",)


def _rope_parameters(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(global, local)`` RoPE dicts. transformers >= 5 writes ``rope_parameters`` keyed by layer type (each
    with its ``rope_theta``); older configs write ``rope_theta``, ``rope_scaling`` (global) and
    ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"model config rope_parameters={params!r} must be a JSON object")
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(params or cfg.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return full, local


def _check_supported(cfg: Mapping[str, Any]) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"model config {key}={cfg[key]!r} is not supported: kv8's Gemma 3 implements no "
                             f"logit soft-capping (it needs {key}=null, as Gemma 3 checkpoints have)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("model config use_bidirectional_attention=true is not supported: kv8 runs Gemma 3 as a "
                         "causal decoder")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or _ACTIVATIONS[0]
    if activation not in _ACTIVATIONS:
        raise ValueError(f"model config hidden_activation={activation!r} is not supported by kv8's Gemma 3; "
                         f"supported: {', '.join(_ACTIVATIONS)}")


@dataclass(frozen=True)
class Gemma3ArchConfig(ModelArchConfig):
    """:class:`ModelArchConfig` plus Gemma 3's own settings. The base ``rope_theta`` / ``rope_scaling`` are the
    global layers'; ``rope_local_theta`` is the local layers' base (never scaled)."""

    query_pre_attn_scalar: float = 256.0
    rope_local_theta: float = 10_000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value in (("query_pre_attn_scalar", self.query_pre_attn_scalar),
                            ("rope_local_base_freq", self.rope_local_theta)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"model config {name}={value!r} must be a finite number > 0")

    @classmethod
    def extra_fields(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Gemma 3's fields, and the base fields its config spells its own way: the global RoPE (from
        ``rope_parameters``) and ``layer_types`` (from ``sliding_window_pattern`` in configs without them:
        every ``pattern``-th layer global, transformers' default 6)."""
        _check_supported(cfg)
        full, local = _rope_parameters(cfg)
        local_type = local.get("rope_type", local.get("type", "default"))
        if local_type != "default":
            raise ValueError(f"model config rope_parameters['sliding_attention'] has rope_type={local_type!r}; "
                             f"kv8's Gemma 3 supports only unscaled RoPE ('default') on sliding layers")
        fields: dict[str, Any] = {
            "rope_theta": cfg_float(full, "rope_theta", 1_000_000.0),
            "rope_scaling": RopeScaling.from_dict(full),
            "rope_local_theta": cfg_float(local, "rope_theta", 10_000.0),
            "query_pre_attn_scalar": cfg_float(cfg, "query_pre_attn_scalar", 256.0),
        }
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            key = "sliding_window_pattern" if "sliding_window_pattern" in cfg else "_sliding_window_pattern"
            pattern = cfg_int(cfg, key, 6)
            if pattern < 1:
                raise ValueError(f"model config {key}={pattern!r} must be an int >= 1")
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(cfg_int(cfg, "num_hidden_layers"))]
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ValueError(f"model config layer_types={layer_types!r} must be a list of strings")
        fields["layer_types"] = tuple(layer_types)   # kept without a sliding_window: the base check names it
        return fields


class Gemma3Attention(nn.Module):
    def __init__(self, arch: Gemma3ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 backend: DenseBackend) -> None:
        super().__init__()
        e, d, hq, hkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
        self.qkv_proj = QKVLinear(e, d, hq, hkv, arch.attention_bias, backend)
        self.q_norm = GemmaRMSNorm(d, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, arch.rms_norm_eps)
        self.rotary_emb = rotary_emb   # this layer kind's, shared by the layers of that kind
        local_hq, local_hkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads   # this rank's heads
        self.attn = PagedAttention(layer_idx, local_hq, local_hkv, d, arch.query_pre_attn_scalar ** -0.5)
        self.o_proj = RowParallelLinear(hq * d, e, arch.attention_bias, backend)

    def forward(self, x: torch.Tensor, rope: RopeAngles, ctx: AttentionContext) -> torch.Tensor:
        q, k, v = self.rotary_emb.split(self.qkv_proj(x))              # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        q, k = norm_per_head(self.q_norm, q), norm_per_head(self.k_norm, k)
        q, k = self.rotary_emb.rotate(q, k, rope)
        return self.o_proj(self.attn(q, k, v.contiguous(), ctx))     # [T, Hq * D] -> [T, E]


class Gemma3MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: DenseBackend) -> None:
        super().__init__()
        e, i = arch.hidden_size, arch.intermediate_size
        self.gate_up_proj = GateUpLinear(e, i, False, backend, GeluAndMul())   # gelu_tanh(gate) * up
        self.down_proj = RowParallelLinear(i, e, False, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))   # [T, E] -> gelu_tanh(gate) * up [T, I] -> [T, E]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: Gemma3ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 backend: DenseBackend) -> None:
        super().__init__()
        e, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(e, eps)
        self.self_attn = Gemma3Attention(arch, layer_idx, rotary_emb, backend)
        self.post_attention_layernorm = GemmaRMSNorm(e, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(e, eps)
        self.mlp = Gemma3MLP(arch, backend)
        self.post_feedforward_layernorm = GemmaRMSNorm(e, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeAngles,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed mlp output, residual stream)``; as in :mod:`kv8.models.llama` the next norm adds the two
        (the first layer gets ``residual=None``)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, ctx))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class Gemma3Model(nn.Module):
    def __init__(self, arch: Gemma3ArchConfig, backend: DenseBackend) -> None:
        super().__init__()
        d, (hq, hkv) = arch.head_dim, local_head_counts(arch.num_heads, arch.num_kv_heads)   # this rank's heads
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, backend)
        # one RoPE per layer kind: global (rope_theta, scaled) and local (rope_local_base_freq, unscaled)
        self.rotary_emb = RotaryEmbedding(d, hq, hkv, arch.rope_theta, arch.rope_scaling, backend)
        self.rotary_emb_local = RotaryEmbedding(d, hq, hkv, arch.rope_local_theta, None, backend)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, i, self.rotary_emb_local if kind == "sliding_attention" else self.rotary_emb,
                               backend)
            for i, kind in enumerate(arch.layer_types))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)


class Gemma3ForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, E]``; ``compute_logits`` projects selected rows."""

    # checkpoint module name -> (merged module name, shard id): the same names as the Llama family's
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    arch_config_cls = Gemma3ArchConfig

    def __init__(self, arch: ModelArchConfig, backend: DenseBackend = TORCH_BACKEND) -> None:
        super().__init__()
        if not isinstance(arch, Gemma3ArchConfig):
            raise ValueError(f"Gemma3ForCausalLM needs a Gemma3ArchConfig, got {type(arch).__name__}")
        self.arch = arch
        self.model = Gemma3Model(arch, backend)
        self.lm_head = ParallelLMHead(arch.hidden_size, arch.vocab_size, backend)
        self.layer_is_local = [kind == "sliding_attention" for kind in arch.layer_types]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions ``[T]`` -> final hidden states ``[T, E]`` (normed)."""
        x = self.model.embed_tokens(input_ids)                                 # [T, E]
        x = x * torch.tensor(self.arch.hidden_size ** 0.5).to(x.dtype)        # scale rounded as transformers does
        rope_global = self.model.rotary_emb.angles(positions, x.dtype)
        rope_local = self.model.rotary_emb_local.angles(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer, local in zip(self.model.layers, self.layer_is_local, strict=True):
            x, residual = layer(x, residual, rope_local if local else rope_global, ctx)
        return self.model.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, E]`` -> logits ``[N, V]`` in float32 (on rank 0; every rank calls it on the same rows)."""
        return self.lm_head(hidden).float()
