"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Module and parameter names follow Hugging Face's (``model.layers.N.self_attn.q_proj.weight`` ...) so
checkpoints load by name. Shapes in comments: ``T`` = tokens in the flattened batch, ``Hq``/``Hkv`` = query/KV
heads, ``D`` = head dim, ``E`` = hidden size. The model is built on the meta device and its parameters are
assigned from the checkpoint (:mod:`kv8.model.loader`), so weights exist in memory once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kv8.config import ModelArchConfig, RopeScaling
from kv8.layers.attention import AttentionContext, PagedAttention
from kv8.model.cpu_dense import DenseKernels, PackedLinear, apply_rope, rmsnorm_reference


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.kernels: DenseKernels | None = None  # set by LlamaForCausalLM.use_cpu_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(h), h)`` with ``h = x + residual`` (or ``x``): the residual add is fused into the norm."""
        if self.kernels is not None:
            return self.kernels.rmsnorm(x, residual, self.weight, self.eps)
        return rmsnorm_reference(x, residual, self.weight, self.eps)


def rope_inv_freq(arch: ModelArchConfig) -> torch.Tensor:
    """Inverse frequencies ``[D / 2]`` (float32, CPU), with the config's rope scaling applied."""
    d = arch.head_dim
    # float32 throughout, as Hugging Face computes it, so positions rotate identically.
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs: RopeScaling | None = arch.rope_scaling
    if rs is not None and rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs is not None and rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return inv.float()


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        e, d = arch.hidden_size, arch.head_dim
        bias = arch.attention_bias
        self.q_proj = nn.Linear(e, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(e, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(e, self.num_kv_heads * d, bias=bias)
        self.o_proj: nn.Module = nn.Linear(self.num_heads * d, e, bias=False)
        self.qkv_proj: PackedLinear | None = None  # q/k/v packed into one matrix (use_cpu_kernels)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:                                   # cos/sin: [T, D/2] float32
            q, k, v = self.qkv_proj.lib.rope_qkv(self.qkv_proj(x), cos, sin, self.num_heads, self.num_kv_heads,
                                                 self.head_dim)
        else:                                                             # cos/sin: [T, 1, D], x's dtype
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)         # [T, Hq, D]
            k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)      # [T, Hkv, D]
            v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)      # [T, Hkv, D]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, ctx))


class MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj: nn.Module = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.gate_up_proj: PackedLinear | None = None  # gate and up packed into one matrix (use_cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(self.gate_up_proj.lib.silu_mul(self.gate_up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``; the next norm adds the two (the previous layer's output is
        ``x + residual``; the first layer gets ``residual=None``)."""
        h, residual = self.input_layernorm(x, residual)
        x = self.self_attn(h, cos, sin, ctx)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, E]``; ``compute_logits`` projects selected rows."""

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.lm_head: nn.Module = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self.kernels: DenseKernels | None = None  # use_cpu_kernels

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``[T]`` (angles computed in float32): ``[T, D/2]`` float32 for the CPU
        kernels, else ``[T, 1, D]`` in ``dtype`` (both halves)."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)   # [T, D/2]
        if self.kernels is not None:
            return freqs.cos(), freqs.sin()
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)                   # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)                                 # [T, E]
        cos, sin = self.rope(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.model.norm(x, residual)[0]

    def use_cpu_kernels(self, kernels: DenseKernels) -> None:
        """Run the dense part on kv8's CPU kernels (:mod:`kv8.model.cpu_dense`): every projection becomes a
        :class:`PackedLinear` (q/k/v and gate/up each packed into one matrix; the ``nn.Linear`` weights are
        dropped, so weights stay in memory once), and norms, SiLU * up and RoPE run fused. Needs bf16 weights."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = PackedLinear(kernels, [attn.q_proj, attn.k_proj, attn.v_proj])
            del attn.q_proj, attn.k_proj, attn.v_proj
            attn.o_proj = PackedLinear(kernels, [attn.o_proj])
            mlp.gate_up_proj = PackedLinear(kernels, [mlp.gate_proj, mlp.up_proj])
            del mlp.gate_proj, mlp.up_proj
            mlp.down_proj = PackedLinear(kernels, [mlp.down_proj])
            layer.input_layernorm.kernels = layer.post_attention_layernorm.kernels = kernels
        self.model.norm.kernels = kernels
        self.lm_head = PackedLinear(kernels, [self.lm_head])
        self.kernels = kernels

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, E]`` -> logits ``[N, V]`` in float32."""
        return self.lm_head(hidden).float()
