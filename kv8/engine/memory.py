"""What one rank's model takes on its GPU besides the KV cache, estimated from the architecture before anything is
loaded: :func:`estimate_device_reserve` (a :class:`kv8.cache.budget.DeviceReserve`), which the default GPU budget
(``gpu_memory_utilization``, :func:`kv8.cache.budget.gpu_kv_cache_memory`) leaves out.

* **Weights**: every parameter the decoder holds on the rank -- the embedding and the LM head split by vocabulary
  (one matrix when they are tied), the attention and MLP projections split by heads and intermediate size, K/V
  heads replicated where ranks outnumber them, q/k/v biases where the model has them, two norms per layer and the
  final one -- in the compute dtype. With FP8 weights held as codes (``quantization="fp8"`` on a GPU with FP8
  tensor cores) the decoder's projections take one byte per weight and a float32 scale per output row. Exact for
  the Llama family (Llama-3.1-8B: 8,030,261,248 parameters); Gemma 3 and Qwen3 hold a few more norm weights.
* **Activations**: a step of ``max_num_batched_tokens`` tokens holds at most, for one layer, the residual stream
  and its normed copy, q, k, v and the attention output, and the MLP's gate, up and activated product (in the
  compute dtype), plus the float32 logits of ``max_num_seqs`` rows and two working copies of them (sampling).
  That sum is doubled for the caching allocator's fragmentation and the CUDA graphs' pool.

A reserve, not a measurement: vLLM measures the weights and a profile run once they are loaded, while kv8 sizes
the cache before loading (every tensor-parallel rank gets the same blocks). The cache is checked against the memory
free once the weights are in (:meth:`kv8.cache.budget.KVBudget.check_fits_memory`), so an estimate short of the truth
fails there with an error naming the option, not with an out-of-memory error in a step.
"""

from __future__ import annotations

import torch

from kv8.cache.budget import DeviceReserve
from kv8.models.config import ModelArchConfig

__all__ = ["estimate_device_reserve", "num_parameters"]


def num_parameters(arch: ModelArchConfig, tp_size: int = 1, kv_heads: int | None = None) -> tuple[int, int]:
    """``(projections, others)``: the parameters of one rank's decoder projections (q/k/v/o, gate/up/down), and of
    everything else (embedding, LM head, biases, norms). ``kv_heads``: the rank's KV heads (default: the model's
    split over ``tp_size`` ranks, at least one)."""
    kv = kv_heads if kv_heads is not None else max(1, arch.num_kv_heads // tp_size)
    hidden, dim = arch.hidden_size, arch.head_dim
    q_width, kv_width = arch.num_heads // tp_size * dim, kv * dim
    inter = arch.intermediate_size // tp_size
    per_layer = hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * inter
    vocab_rows = -(-arch.vocab_size // tp_size)
    others = vocab_rows * hidden * (1 if arch.tie_word_embeddings else 2) + (2 * arch.num_layers + 1) * hidden
    if arch.attention_bias:
        others += arch.num_layers * (q_width + 2 * kv_width)
    return arch.num_layers * per_layer, others


def estimate_device_reserve(arch: ModelArchConfig, dtype: torch.dtype, *, fp8_codes: bool, tp_size: int,
                            kv_heads: int, max_num_batched_tokens: int, max_num_seqs: int) -> DeviceReserve:
    """Bytes one rank's weights and largest step take on its GPU (see the module docstring). ``fp8_codes``: the
    decoder's projections are held as E4M3 codes with a float32 scale per output row."""
    size = torch.empty((), dtype=dtype).element_size()
    projections, others = num_parameters(arch, tp_size, kv_heads)
    if fp8_codes:
        q_width, kv_width = arch.num_heads // tp_size * arch.head_dim, kv_heads * arch.head_dim
        # output rows of q, k, v, o, gate, up, down: one float32 scale each
        rows = arch.num_layers * (q_width + 2 * kv_width + 2 * (arch.hidden_size + arch.intermediate_size // tp_size))
        weights = projections + 4 * rows + others * size
    else:
        weights = (projections + others) * size
    hidden, dim = arch.hidden_size, arch.head_dim
    per_token = (2 * hidden + (arch.num_heads // tp_size * 2 + 2 * kv_heads) * dim
                 + 3 * (arch.intermediate_size // tp_size))
    logits = 3 * max_num_seqs * arch.vocab_size * 4
    return DeviceReserve(weights=weights, activations=2 * (max_num_batched_tokens * per_token * size + logits))
