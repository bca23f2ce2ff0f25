"""The embedding and the LM head split by vocabulary over tensor-parallel ranks (Megatron's vocab-parallel layers).

With ``N`` ranks and a vocabulary of ``V`` tokens, rank ``r`` holds rows ``[r * P, (r + 1) * P)`` of the
``[V, E]`` matrix, ``P = ceil(V / N)`` (:func:`vocab_shard`); rows past ``V`` (the last rank's padding) are zeros.
Every rank's parameter has the same ``[P, E]`` shape, so a tied LM head shares the embedding's shard and the
gathered logits have equal parts.

* :class:`VocabParallelEmbedding`: each rank looks up the ids it holds (zeros for the others) and one all-reduce
  sums the ranks' rows: every rank gets the whole ``[T, E]`` embedding.
* :class:`ParallelLMHead`: each rank multiplies by its rows (``[N, P]`` logits) and the ranks' parts are gathered
  on rank 0, which concatenates them and drops the padding: rank 0 gets ``[N, V]``; other ranks get their own
  part (which they do not use). Every rank must call it on the same rows, in the same order (the runner's
  ``StepInputs.logit_rows``).

With one rank both are the plain layers (the whole matrix, no collective). The weights load through
``weight_loader`` (a whole checkpoint tensor, checked against ``[V, E]``; the rank keeps its rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kv8.distributed.group import TPGroup
from kv8.distributed.shard import shard_group
from kv8.layers.dense_backend import DenseBackend
from kv8.layers.linear import LinearBase

__all__ = ["ParallelLMHead", "VocabParallelEmbedding", "vocab_shard"]


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """``(first row, rows held (padding included), real rows)`` of rank ``tp.rank``."""
    per_rank = -(-vocab_size // tp.size)
    first = tp.rank * per_rank
    return first, per_rank, max(0, min(per_rank, vocab_size - first))


def _load_rows(param: nn.Parameter, loaded: torch.Tensor, vocab_size: int, dim: int, tp: TPGroup) -> None:
    if tuple(loaded.shape) != (vocab_size, dim):
        raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {(vocab_size, dim)}")
    first, _, real = vocab_shard(vocab_size, tp)
    param.data.zero_()
    param.data[:real].copy_(loaded.narrow(0, first, real))


class VocabParallelEmbedding(nn.Module):
    """``ids [T] -> [T, E]`` with this rank's ``[P, E]`` rows of the ``[V, E]`` table (see the module docstring)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = shard_group()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.first, rows, _ = vocab_shard(num_embeddings, self.tp)
        self.is_sharded = self.tp.size > 1
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _load_rows(param, loaded, self.num_embeddings, self.embedding_dim, self.tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.is_sharded:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        shard = f", rows {self.first}..{self.first + self.weight.shape[0] - 1}" if self.is_sharded else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{shard}"


class ParallelLMHead(LinearBase):
    """``hidden [N, E] -> logits [N, V]`` on rank 0, from every rank's ``[P, E]`` rows (see the module
    docstring). The linear method (torch or packed bf16) multiplies the rank's rows as for any linear layer; the
    weights stay as loaded under ``quantization="fp8"`` (as vLLM keeps its LM head; a tied head is the
    embedding's matrix)."""

    def __init__(self, hidden_size: int, vocab_size: int, backend: DenseBackend) -> None:
        tp = shard_group()
        first, rows, _ = vocab_shard(vocab_size, tp)
        self.vocab_size = vocab_size
        super().__init__(hidden_size, [rows * tp.size], False, backend, row_shards=[(first, rows)], quantize=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        _load_rows(param, loaded, self.vocab_size, self.full_in_features, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.method.apply(self, x)                                     # [N, P]
        if not self.is_sharded:
            return part
        parts = self.tp.gather_to_driver(part.contiguous())
        return part if parts is None else torch.cat(parts, dim=-1)[..., :self.vocab_size]
