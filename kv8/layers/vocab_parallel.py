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

With ``quantization="gguf"`` both keep the file's blocks (each rank its ``[P, E]`` rows, :func:`vocab_rows`: the
last rank's padding rows zero bytes, blocks that dequantize to 0) when their type has a kernel (Q8_0, Q4_0, Q4_1,
Q5_0, Q4_K, Q6_K: :data:`~kv8.quant.gguf_blocks.KEPT_TYPES`), loaded through ``load_gguf``: the embedding holds a
:class:`~kv8.layers.linear.GGUFSegment` (grouped in the kernel's order where the kernels read the type) and looks up
its rows by dequantizing only the blocks of the ids asked for (:meth:`GGUFSegment.lookup`: the values the dequantized
embedding would hold, bit for bit); the LM head multiplies by its blocks with :class:`~kv8.layers.linear.
GGUFLinearMethod` (the int8 kernel below :data:`GGUF_HEAD_DEQUANTIZE_ROWS` rows). A tied pair shares one segment: the
embedding's, handed to the head (:meth:`VocabParallelEmbedding.tied_gguf_part`), so the blocks are in memory once. A
type without a kernel (Q5_K, F16, ...) is dequantized at load to the compute dtype, as without the option.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kv8.distributed.group import TPGroup
from kv8.distributed.shard import shard_group
from kv8.layers.dense_backend import TORCH_BACKEND, DenseBackend
from kv8.layers.linear import GGUFLinearMethod, GGUFSegment, LinearBase, gguf_segment
from kv8.quant.gguf_blocks import ExpandedWeight, GGUFWeight, shard_weight

__all__ = ["GGUF_HEAD_DEQUANTIZE_ROWS", "ParallelLMHead", "VocabParallelEmbedding", "vocab_rows", "vocab_shard"]

#: the LM head's row count from which :class:`GGUFLinearMethod` dequantizes its blocks (slice by slice) and runs the
#: float32 GEMM, instead of the int8 kernel. Measured on the Xeon (model 207, AVX-512 VNNI), SmolLM2's Q8_0 head
#: [49152, 576], one thread's CPU time, int8 kernel / dequantize+GEMM: on the kernel's AVX2 path 0.97 at 64 rows, 1.28
#: at 128, 1.39 at 512; on its vnni512 path 0.32 at 64 rows, 0.34 at 128, 0.68 at 512 (the int8 kernel faster at every
#: row count). 96 is the AVX2 path's switch, kept on every machine whatever the decoder's layers do (the backend's
#: ``wide_rows``): a step's head multiplies one row per sequence, so calls of >= 96 rows are prompt
#: log-probabilities, where the float32 path's accuracy (no activation rounding: 0.9e-3 nats less KLD on SmolLM2,
#: docs/benchmarks.md) is worth more than the int8 kernel's speed.
GGUF_HEAD_DEQUANTIZE_ROWS = 96


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """``(first row, rows held (padding included), real rows)`` of rank ``tp.rank``."""
    per_rank = -(-vocab_size // tp.size)
    first = tp.rank * per_rank
    return first, per_rank, max(0, min(per_rank, vocab_size - first))


def vocab_rows(loaded: GGUFWeight | ExpandedWeight, vocab_size: int, tp: TPGroup) -> GGUFWeight | ExpandedWeight:
    """Rank ``tp.rank``'s ``[P, E]`` rows of a GGUF table ``[V, E]`` (:func:`vocab_shard`; the padding rows zeros,
    blocks that dequantize to 0), in memory of its own; the table itself with one rank."""
    if tp.size == 1:
        return loaded
    first, rows, _ = vocab_shard(vocab_size, tp)
    return shard_weight(loaded, (first, rows), (0, loaded.shape[1]))


def _load_rows(param: nn.Parameter, loaded: torch.Tensor, vocab_size: int, dim: int, tp: TPGroup) -> None:
    if tuple(loaded.shape) != (vocab_size, dim):
        raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {(vocab_size, dim)}")
    first, _, real = vocab_shard(vocab_size, tp)
    param.data.zero_()
    param.data[:real].copy_(loaded.narrow(0, first, real))


class VocabParallelEmbedding(nn.Module):
    """``ids [T] -> [T, E]`` with this rank's ``[P, E]`` rows of the ``[V, E]`` table (see the module docstring).

    ``gguf`` (the backend's ``quantization="gguf"``): the table may come as GGUF blocks (``load_gguf``); then the
    module holds ``gguf_rows`` (a :class:`GGUFSegment`) and no ``weight``, and returns rows in ``dtype``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, backend: DenseBackend = TORCH_BACKEND) -> None:
        super().__init__()
        self.tp = shard_group()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.first, rows, _ = vocab_shard(num_embeddings, self.tp)
        self.num_embeddings_per_rank = rows
        self.is_sharded = self.tp.size > 1
        self.gguf = backend.quantization == "gguf"
        self.kernels = backend.kernels
        self.gguf_rows: GGUFSegment | None = None
        self.gguf_qtype: str | None = None   # the file's type of the table under quantization="gguf"
        self.dtype: torch.dtype | None = None
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _load_rows(param, loaded, self.num_embeddings, self.embedding_dim, self.tp)

    def load_gguf(self, loaded: GGUFWeight | ExpandedWeight, dtype: torch.dtype) -> None:
        """``quantization="gguf"``: keep the table's blocks (rows looked up in ``dtype``), or take a table of a type
        without a kernel dequantized at load as the ``weight``; the rank's rows of either (:func:`vocab_rows`)."""
        if not self.gguf:
            raise ValueError("holds GGUF blocks, but the model was not built for quantization='gguf'")
        if loaded.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"has shape {loaded.shape}, the model expects {(self.num_embeddings, self.embedding_dim)}")
        loaded = vocab_rows(loaded, self.num_embeddings, self.tp)
        self.gguf_qtype, self.dtype = loaded.qtype, dtype
        if isinstance(loaded, ExpandedWeight):
            self.weight = nn.Parameter(loaded.weight, requires_grad=False)
            return
        self.gguf_rows = gguf_segment([loaded], self.embedding_dim, self.kernels)
        del self.weight

    def tied_gguf_part(self) -> GGUFSegment | ExpandedWeight | None:
        """What a tied LM head loads under ``quantization="gguf"`` (``load_gguf``): this table's segment of blocks
        (shared: one copy), or its dequantized ``weight``; None when the table did not come from ``load_gguf``."""
        if self.gguf_rows is not None:
            return self.gguf_rows
        if self.gguf_qtype is None:
            return None
        return ExpandedWeight(self.gguf_qtype, self.weight, "token_embd.weight")

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (each in ``[0, P)``) of this rank's table: looked up in the blocks, or the table's."""
        if self.gguf_rows is not None:
            assert self.dtype is not None
            return self.gguf_rows.lookup(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.is_sharded:
            return self._rows(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings_per_rank)
        out = self._rows(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        if self.gguf_rows is not None:
            return f"{self.num_embeddings}, {self.embedding_dim}, {self.gguf_rows.qtype} blocks"
        shard = f", rows {self.first}..{self.first + self.weight.shape[0] - 1}" if self.is_sharded else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{shard}"


class ParallelLMHead(LinearBase):
    """``hidden [N, E] -> logits [N, V]`` on rank 0, from every rank's ``[P, E]`` rows (see the module
    docstring). The linear method (torch or packed bf16) multiplies the rank's rows as for any linear layer; the
    weights stay as loaded under ``quantization="fp8"`` (as vLLM keeps its LM head; a tied head is the
    embedding's matrix), and as the file's blocks under ``quantization="gguf"`` (:class:`GGUFLinearMethod`, with
    :data:`GGUF_HEAD_DEQUANTIZE_ROWS`). The logits come in the input's dtype, as from the other methods."""

    def __init__(self, hidden_size: int, vocab_size: int, backend: DenseBackend) -> None:
        tp = shard_group()
        first, rows, _ = vocab_shard(vocab_size, tp)
        self.vocab_size = vocab_size
        gguf = backend.quantization == "gguf"
        super().__init__(hidden_size, [rows * tp.size], False, backend, row_shards=[(first, rows)], quantize=gguf)
        if gguf:
            self.method = GGUFLinearMethod(backend.kernels, GGUF_HEAD_DEQUANTIZE_ROWS, path=backend.gguf_head_path)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        _load_rows(param, loaded, self.vocab_size, self.full_in_features, self.tp)

    def load_gguf(self, loaded: GGUFWeight | ExpandedWeight | GGUFSegment, shard_id: int | str | None = None) -> None:
        """The head's GGUF table ``[V, E]`` (the file's ``output.weight``), of which the rank keeps its rows
        (:func:`vocab_rows`), or a tied embedding's part of this rank's rows (a segment, or its dequantized table
        ``[P, E]``)."""
        if isinstance(loaded, GGUFSegment):
            super().load_gguf(loaded, shard_id)
            return
        if not isinstance(self.method, GGUFLinearMethod):
            raise ValueError(f"holds GGUF blocks, but the layer's method is {self.method.name!r}, not 'gguf'")
        if loaded.shape == (self.vocab_size, self.in_features):
            loaded = vocab_rows(loaded, self.vocab_size, self.tp)
        elif loaded.shape != (self.out_features, self.in_features):   # not a tied table of this rank's rows either
            raise ValueError(f"has shape {loaded.shape}, the model expects {(self.vocab_size, self.in_features)}")
        self.gguf_parts[0] = loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.method.apply(self, x)                                     # [N, P]
        if not self.is_sharded:
            return part
        parts = self.tp.gather_to_driver(part.contiguous())
        return part if parts is None else torch.cat(parts, dim=-1)[..., :self.vocab_size]
