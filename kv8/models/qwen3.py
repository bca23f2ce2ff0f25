"""Qwen3: the Llama-family decoder with QK-norm.

Only the attention block differs from :mod:`kv8.models.llama`: after the q/k/v projection (no biases), q and k
are RMS-normalised per head over ``head_dim`` (``self_attn.q_norm`` / ``k_norm``, weights ``[D]``) and only then
rotated. Everything else -- the norms, the MLP, tied embeddings, the checkpoint names and
``packed_modules_mapping`` -- is the family's. Shapes: ``T`` tokens, ``Hq``/``Hkv`` heads, ``D`` head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from kv8.layers.attention import AttentionContext, PagedAttention
from kv8.layers.dense_backend import DenseBackend
from kv8.layers.linear import QKVLinear, RowParallelLinear
from kv8.layers.norm import RMSNorm, norm_per_head
from kv8.layers.rotary import RopeAngles, RotaryEmbedding
from kv8.models.config import ModelArchConfig
from kv8.models.llama import LlamaForCausalLM


class Qwen3Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 backend: DenseBackend) -> None:
        super().__init__()
        e, d, hq, hkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
        self.head_dim = d
        self.qkv_proj = QKVLinear(e, d, hq, hkv, arch.attention_bias, backend)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps, backend)
        self.k_norm = RMSNorm(d, arch.rms_norm_eps, backend)
        self.rotary_emb = rotary_emb   # shared by all layers
        local_hq, local_hkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads   # this rank's heads
        self.attn = PagedAttention(layer_idx, local_hq, local_hkv, d, d ** -0.5)
        self.o_proj = RowParallelLinear(hq * d, e, False, backend)

    def forward(self, x: torch.Tensor, rope: RopeAngles, ctx: AttentionContext) -> torch.Tensor:
        q, k, v = self.rotary_emb.split(self.qkv_proj(x))              # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        q, k = norm_per_head(self.q_norm, q), norm_per_head(self.k_norm, k)
        q, k = self.rotary_emb.rotate(q, k, rope)
        return self.o_proj(self.attn(q, k, v.contiguous(), ctx))     # [T, Hq * D] -> [T, E]


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
