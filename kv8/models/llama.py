"""The Llama-family decoder (Llama, Mistral, Qwen2 with q/k/v biases) over a paged KV cache.

Only the architecture's math, one code path: embed; per layer norm, qkv_proj, RoPE, paged attention, o_proj,
norm, gate_up_proj, SiLU * up, down_proj; final norm; lm_head (tied to the embedding when the config says
so). How each layer computes (torch or kv8's packed bf16 kernels) is fixed by the :class:`DenseBackend`
given to the constructor.

Parameter names follow Hugging Face's where a checkpoint tensor maps one to one
(``model.layers.N.self_attn.o_proj.weight``); q/k/v and gate/up are merged, and
:attr:`LlamaForCausalLM.packed_modules_mapping` tells the loader which shard each checkpoint tensor fills.
Shapes in comments: ``T`` = tokens in the flattened batch, ``Hq``/``Hkv`` = query/KV heads, ``D`` = head dim,
``E`` = hidden size, ``I`` = intermediate size, ``V`` = vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from kv8.distributed.shard import local_head_counts
from kv8.layers.activation import SiluAndMul
from kv8.layers.attention import AttentionContext, PagedAttention
from kv8.layers.dense_backend import TORCH_BACKEND, DenseBackend
from kv8.layers.linear import GateUpLinear, QKVLinear, RowParallelLinear
from kv8.layers.norm import RMSNorm
from kv8.layers.rotary import RopeAngles, RotaryEmbedding
from kv8.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from kv8.models.config import ModelArchConfig


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 backend: DenseBackend) -> None:
        super().__init__()
        e, d, hq, hkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
        self.qkv_proj = QKVLinear(e, d, hq, hkv, arch.attention_bias, backend)
        self.rotary_emb = rotary_emb   # shared by all layers
        local_hq, local_hkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads   # this rank's heads
        self.attn = PagedAttention(layer_idx, local_hq, local_hkv, d, d ** -0.5)
        self.o_proj = RowParallelLinear(hq * d, e, False, backend)

    def forward(self, x: torch.Tensor, rope: RopeAngles, ctx: AttentionContext) -> torch.Tensor:
        q, k, v = self.rotary_emb(self.qkv_proj(x), rope)        # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        return self.o_proj(self.attn(q, k, v, ctx))              # [T, Hq * D] -> [T, E]


class MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: DenseBackend) -> None:
        super().__init__()
        e, i = arch.hidden_size, arch.intermediate_size
        self.gate_up_proj = GateUpLinear(e, i, False, backend, SiluAndMul(backend))   # silu(gate) * up
        self.down_proj = RowParallelLinear(i, e, False, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))   # [T, E] -> silu(gate) * up [T, I] -> [T, E]


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 backend: DenseBackend, attention_cls: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backend)
        self.self_attn = attention_cls(arch, layer_idx, rotary_emb, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backend)
        self.mlp = MLP(arch, backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeAngles,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``; the next norm adds the two (the previous layer's output is
        ``x + residual``; the first layer gets ``residual=None``)."""
        h, residual = self.input_layernorm(x, residual)
        x = self.self_attn(h, rope, ctx)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: DenseBackend, attention_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, backend)
        hq, hkv = local_head_counts(arch.num_heads, arch.num_kv_heads)   # this rank's heads
        self.rotary_emb = RotaryEmbedding(arch.head_dim, hq, hkv, arch.rope_theta, arch.rope_scaling, backend,
                                          rotary_dim=arch.rotary_dim)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, self.rotary_emb, backend, attention_cls)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backend)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, E]``; ``compute_logits`` projects selected rows."""

    # checkpoint module name -> (merged module name, shard id)
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # parameter -> the parameter it shares, when the config ties word embeddings
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    # the attention block; family members that differ only there (Qwen3's QK-norm) name their own
    attention_cls: type[nn.Module] = Attention
    arch_config_cls = ModelArchConfig

    def __init__(self, arch: ModelArchConfig, backend: DenseBackend = TORCH_BACKEND) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, backend, self.attention_cls)
        self.lm_head = ParallelLMHead(arch.hidden_size, arch.vocab_size, backend)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions ``[T]`` -> final hidden states ``[T, E]`` (normed)."""
        x = self.model.embed_tokens(input_ids)                                 # [T, E]
        rope = self.model.rotary_emb.angles(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, ctx)
        return self.model.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, E]`` -> logits ``[N, V]`` in float32 (on rank 0; every rank calls it on the same rows)."""
        return self.lm_head(hidden).float()
