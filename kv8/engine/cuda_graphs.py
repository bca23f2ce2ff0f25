"""Decode steps replayed from graphs: CUDA graphs on a GPU (vLLM's scheme), CPU graphs of small batches on the CPU
(``enforce_eager=True`` turns both off).

A small model's decode step on a GPU is launch-bound: a few hundred kernels of a few microseconds each, every
one launched from Python. :class:`DecodeGraphs` captures the model's forward for a pure decode batch (one new
token per sequence) once per batch-size bucket, over static buffers, and replays it: one launch per step. On the
CPU a small batch's step is bound by the same Python (module calls, argument checks, ctypes structs and tensors
around ~300 kernel calls of tens of microseconds): there each bucket up to :data:`CPU_GRAPH_MAX_BATCH` is a
:class:`kv8.kernels.cpu.graph.CPUGraph`, the forward's kernel calls and torch operators recorded once and replayed
in a loop. A forward that a CPU graph cannot replay (:class:`~kv8.kernels.cpu.graph.CaptureRefused`: an operator
whose result Python reads) raises from :meth:`DecodeGraphs.capture_all`; the runner then runs every step eagerly.

Static buffers of bucket ``b`` (filled by :meth:`DecodeGraphs.run` before each replay)::

    input_ids, positions          [b]                 rows n..b-1: 0
    per KV cache group g:
      slot_mapping                [b]                 rows n..b-1: -1 (the store skips them)
      query_start_loc             [b + 1]             0, 1, ..., b  (constant)
      seq_lens                    [b]                 rows n..b-1: 1
      block_tables                [b, max_blocks]     rows 0..n-1: the tables; past a row's table and rows
                                                      n..b-1: block ids of earlier steps (0 at first)
    hidden (the graph's output)   [b, E]              rows 0..n-1 are the step's

The captured metadata's host lists say every row has one query token and ``max_model_len`` keys: kernels size
their grid from them (never from the tensors), so one graph serves every context length. Padded rows attend
over one key of a valid block and are never read. Capture writes no KV (every slot is -1).

Invariants: a graph points into the runner's KV caches, their codecs' scale tensors and the model's weights as they
were at capture (a CPU graph holds each layer's attention struct); none of them is replaced for the runner's life.
A batch is replayed only when every chunk has one new token and the batch fits the largest bucket;
anything else (prefill, mixed steps, a larger batch) runs eagerly. The output rows equal an eager forward's up
to the kernels' batch-size dependence (none for the Triton kernels: a row's result does not depend on the
others). ``capture=False`` runs the same static-buffer path eagerly: how the CPU tests check the buffers, the
padding and the bucket choice without a GPU.

Inputs reach the buffers without waiting for the device: each is built on the host in page-locked memory
(:meth:`kv8.platform.Platform.host_tensor`) and copied with ``non_blocking=True``, so the host goes on to the
replay (queued behind the copies on the same stream) and then to sampling; the step's one read-back waits.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kv8.attention.metadata import AttentionMetadata, token_slot
from kv8.cache.layout import KVCacheLayout
from kv8.kernels.cpu.graph import CPUGraph
from kv8.platform import CPU, Platform

__all__ = ["CPU_GRAPH_MAX_BATCH", "DecodeGraphs", "decode_buckets"]

#: the largest decode batch a CPU graph serves (buckets 1, 2, 4, 8): above it the Python around the kernels is a
#: small share of a step, and each bucket keeps its forward's intermediate tensors
CPU_GRAPH_MAX_BATCH = 8

logger = logging.getLogger("kv8")


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (vLLM's pattern), the
    last one ``max_num_seqs`` itself."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return tuple(sorted(set(sizes)))


@dataclass
class _Bucket:
    size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]
    hidden: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | CPUGraph | None = None


class DecodeGraphs:
    """The captured decode forwards of one runner. ``forward(input_ids, positions, metas) -> hidden`` is the
    eager forward over given tensors (the runner's model with its caches and backend)."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, list[AttentionMetadata]], torch.Tensor],
                 layout: KVCacheLayout, block_size: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device, capture: bool = True, platform: Platform = CPU) -> None:
        self.forward = forward
        self.platform = platform
        self.layout = layout
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        self.max_blocks = -(-max_model_len // block_size)
        if platform.kind == "cpu":
            max_num_seqs = min(max_num_seqs, CPU_GRAPH_MAX_BATCH)
        self.buckets = {b: self._buffers(b) for b in decode_buckets(max_num_seqs)}
        self._pool: object = None   # the graphs' shared memory pool (torch.cuda.graph_pool_handle())
        self.replays = 0   # decode steps served from the buffers (tests, logs)

    def _buffers(self, b: int) -> _Bucket:
        dev = self.device
        metas = []
        for g in self.layout.groups:
            metas.append(AttentionMetadata(
                slot_mapping=torch.full((b,), -1, dtype=torch.int64, device=dev),
                query_start_loc=torch.arange(b + 1, dtype=torch.int64, device=dev),
                seq_lens=torch.ones(b, dtype=torch.int64, device=dev),
                block_tables=torch.zeros(b, self.max_blocks, dtype=torch.int64, device=dev),
                query_lens_list=(1,) * b, seq_lens_list=(self.max_model_len,) * b,
                sliding_window=g.sliding_window))
        return _Bucket(b, torch.zeros(b, dtype=torch.int64, device=dev), torch.zeros(b, dtype=torch.int64, device=dev),
                       metas)

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` sequences, or None when none does."""
        return next((b for b in self.buckets if b >= n), None)

    def capture_all(self) -> None:
        """Capture every bucket, largest first (they share one memory pool). Each is run eagerly once first
        (Triton compiles, allocations settle)."""
        if not self.capture:
            return
        if self.platform.kind == "cpu":
            self._capture_cpu()
            return
        self._pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            bucket = self.buckets[b]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(bucket.input_ids, bucket.positions, bucket.metas)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                bucket.hidden = self.forward(bucket.input_ids, bucket.positions, bucket.metas)
            bucket.graph = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of decode steps for batch sizes %s", ", ".join(map(str, self.buckets)))

    def _capture_cpu(self) -> None:
        """A :class:`CPUGraph` per bucket; :class:`~kv8.kernels.cpu.graph.CaptureRefused` propagates (nothing kept)."""
        for b in sorted(self.buckets):
            bucket = self.buckets[b]
            graph = CPUGraph()
            bucket.hidden = graph.capture(functools.partial(self.forward, bucket.input_ids, bucket.positions,
                                                            bucket.metas))
            bucket.graph = graph
        first = self.buckets[min(self.buckets)].graph
        assert isinstance(first, CPUGraph)
        logger.info("captured CPU graphs of decode steps for batch sizes %s (%d kernel calls, %d torch operators a "
                    "step at batch size 1)", ", ".join(map(str, self.buckets)), first.num_kernel_calls,
                    first.num_torch_ops)

    def run(self, input_ids: Sequence[int], positions: Sequence[int], seq_lens: Sequence[int],
            group_tables: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
        """Hidden states ``[n, E]`` of a decode step of ``n = len(input_ids)`` sequences (one token each, at
        position ``seq_lens[i] - 1``): ``group_tables[g][i]`` is sequence ``i``'s block table in group ``g``
        (freed entries already 0). The caller checked :meth:`bucket_for`."""
        n = len(input_ids)
        b = self.bucket_for(n)
        assert b is not None, f"no bucket holds {n} sequences"
        bucket = self.buckets[b]
        pad = b - n
        host = self.platform.host_tensor   # page-locked on CUDA: every copy below is asynchronous
        bucket.input_ids.copy_(host(list(input_ids) + [0] * pad, torch.int64), non_blocking=True)
        bucket.positions.copy_(host(list(positions) + [0] * pad, torch.int64), non_blocking=True)
        lens = host(list(seq_lens) + [1] * pad, torch.int64)
        bs = self.block_size
        for meta, tables in zip(bucket.metas, group_tables):
            slots = [token_slot(t, s - 1, bs) for t, s in zip(tables, seq_lens)]
            meta.slot_mapping.copy_(host(slots + [-1] * pad, torch.int64), non_blocking=True)
            meta.seq_lens.copy_(lens, non_blocking=True)
            # only the columns this step's tables fill: the columns past a row's table and the padded rows keep
            # block ids of earlier steps (or 0), which are never read past a row's length
            width = max(len(t) for t in tables)
            rows = [list(t) + [0] * (width - len(t)) for t in tables]
            meta.block_tables[:n, :width].copy_(host(rows, torch.int64), non_blocking=True)
        self.replays += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.hidden is not None
            return bucket.hidden[:n]
        return self.forward(bucket.input_ids, bucket.positions, bucket.metas)[:n]
