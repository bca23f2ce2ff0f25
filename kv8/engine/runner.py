"""Runs one scheduled step: flattens the chunks into one batch, runs the model, samples.

Input: a :class:`SchedulerOutput`, whose chunks carry their requests' block tables. Output: a
:class:`ModelRunnerOutput` with the token sampled for every chunk that reached the end of its request, and the
logprobs that were asked for. The runner reads requests but never changes them, and never touches the KV cache
manager; the scheduler applies the output (:meth:`kv8.engine.scheduler.Scheduler.update`).

Batch layout (T = sum of the chunks' new tokens)::

    input_ids, positions   [T]      chunk 0's tokens, then chunk 1's, ...
    hidden                 [T, E]   row query_start_loc[i + 1] - 1 is the last token of chunk i
    logits                 [S, V]   one row per chunk that samples (S <= number of chunks)

Tensor parallelism: :meth:`ModelRunner.prepare` turns the scheduler output into :class:`StepInputs` (plain
lists, all a rank needs), rank 0 publishes them to the other ranks (:meth:`kv8.distributed.group.TPGroup.publish`)
and every rank runs :meth:`ModelRunner.forward` on its shard. The final hidden states are the same on every
rank (each layer ends with an all-reduce and the rest is replicated). The LM head is vocab-parallel: every rank
computes the logits of its vocabulary rows for the rows ``StepInputs.logit_rows`` lists, in that order, and rank
0 gathers them (:mod:`kv8.layers.vocab_parallel`); rank 0 alone samples, with the requests' own generators, so
the tokens are those of one rank.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kv8.attention.backend import AttentionBackend
from kv8.attention.metadata import AttentionMetadata
from kv8.cache.layout import KVCacheLayout
from kv8.cache.paged_cache import PagedKVCache
from kv8.distributed.group import SINGLE_RANK, TPGroup
from kv8.engine.cuda_graphs import DecodeGraphs
from kv8.engine.request import Request, TokenLogprobs
from kv8.engine.runner_output import ModelRunnerOutput
from kv8.engine.sampler import SamplerOutput, TokenHistory, compute_logprobs, sample, select_argmax
from kv8.engine.scheduler import SchedulerOutput
from kv8.engine.structured import apply_grammar_masks
from kv8.kernels.cpu.graph import CaptureRefused
from kv8.layers.attention import AttentionContext
from kv8.models.registry import CausalLM
from kv8.observer import EngineObserver
from kv8.platform import CPU, Platform

logger = logging.getLogger("kv8")


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs, for every rank: the batch layout of the module docstring, as plain lists."""

    input_ids: list[int]                              # [T]
    positions: list[int]                              # [T]
    query_lens: list[int]                             # per chunk: its new tokens
    seq_lens: list[int]                               # per chunk: tokens in its sequence after this step
    tables: list[tuple[tuple[int, ...], ...]]         # per chunk: its block table of each KV cache group
    # rows of the final hidden states whose logits rank 0 computes, one list per compute_logits call, in call
    # order: first the sampling rows (the last token of each chunk that samples), then the prompt-logprob rows
    # in batches of at most PROMPT_LOGITS_ROWS. Every rank makes the same calls (the LM head is vocab-parallel).
    logit_rows: list[list[int]] = field(default_factory=list)


PROMPT_LOGITS_ROWS = 256   # prompt positions scored per compute_logits call (bounds the [rows, V] float32 buffer)


def prompt_logprob_span(req: Request, start: int, n: int) -> tuple[int, int] | None:
    """Positions ``[first, last)`` whose logits score prompt tokens ``first+1 .. last`` in a chunk of ``n`` new
    tokens from ``start``: those that predict a prompt token not scored yet (``req.prompt_logprobs`` holds one
    entry per scored prompt token, None for the first, so after a preemption nothing is scored twice)."""
    next_token = max(len(req.prompt_logprobs), 1)          # first prompt token not scored yet
    first = max(start, next_token - 1)
    last = min(start + n, req.num_prompt_tokens - 1)       # exclusive bound on predicting positions
    return (first, last) if first < last else None


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``hidden[rows]``, without a copy when the rows are all of them in order (a decode step)."""
    return hidden if rows == list(range(hidden.shape[0])) else hidden[rows]


def _read_back(finite: torch.Tensor, result: SamplerOutput) -> list[list[float]]:
    """The step's one read of device memory (on CUDA the one wait for the device): per sampled row
    ``[finite, token id, logprob, top values (K), top ids (K)]`` as float64 (exact for float32 values and for ids
    below 2**53), the last three only when some row asked for logprobs."""
    fields = [finite.unsqueeze(1), result.token_ids.unsqueeze(1)]
    if result.logprobs is not None and result.top_logprobs is not None:
        fields += [result.logprobs.unsqueeze(1), *result.top_logprobs]
    return torch.cat([f.to(torch.float64) for f in fields], dim=1).tolist()


def _to_token_logprobs(token: torch.Tensor, lp: torch.Tensor, top_v: torch.Tensor, top_i: torch.Tensor,
                       row: int, k: int) -> TokenLogprobs:
    return TokenLogprobs(int(token[row]), float(lp[row]), top_i[row, :k].tolist(), top_v[row, :k].tolist())


class ModelRunner:
    """Owns the model, the paged cache it reads and writes, and the attention backend."""

    def __init__(self, model: CausalLM, caches: Sequence[PagedKVCache], layout: KVCacheLayout,
                 backend: AttentionBackend, observer: EngineObserver | None = None,
                 tp: TPGroup = SINGLE_RANK, device: torch.device | str = "cpu", platform: Platform = CPU) -> None:
        """``caches[p]`` holds pool ``p`` of ``layout``; ``tp`` is the model's group (rank 0 drives); ``device``, one
        of ``platform``'s, holds the model, the caches and every tensor of a step (the inputs are built on the
        host, then copied)."""
        self.model = model
        self.device = torch.device(device)
        self.platform = platform
        self.tp = tp
        self.caches = tuple(caches)
        self.layout = layout
        self.block_size = self.caches[0].shape.block_size
        self.backend = backend
        self.observer = observer
        self.argmax = select_argmax(platform)   # the sampler's row argmax, chosen once
        self.graphs: DecodeGraphs | None = None    # enable_decode_graphs

    def _group_tables(self, tables: list[tuple[tuple[int, ...], ...]]) -> list[list[list[int]]]:
        """Per KV cache group, each chunk's block table with freed entries read as block 0 (they lie before the
        window and are never read)."""
        return [[[max(b, 0) for b in t[g.group_id]] for t in tables] for g in self.layout.groups]

    def _context(self, query_lens: list[int], seq_lens: list[int],
                 tables: list[tuple[tuple[int, ...], ...]]) -> AttentionContext:
        """One :class:`AttentionMetadata` per KV cache group, and each layer's (cache, metadata)."""
        metas = [AttentionMetadata.build(query_lens, seq_lens, group_tables, self.block_size,
                                         sliding_window=g.sliding_window, device=self.device, platform=self.platform)
                 for g, group_tables in zip(self.layout.groups, self._group_tables(tables))]
        return self._context_of(metas)

    def _context_of(self, metas: list[AttentionMetadata]) -> AttentionContext:
        if len(metas) == 1:
            return AttentionContext(self.caches[0], metas[0], self.backend, self.observer)
        per_layer = tuple((self.caches[self.layout.groups[g].pool], metas[g]) for g in self.layout.layer_group)
        return AttentionContext(per_layer[0][0], per_layer[0][1], self.backend, self.observer, per_layer)

    @staticmethod
    def prepare(so: SchedulerOutput) -> StepInputs:
        """The model inputs of a scheduled step: the chunks' new tokens flattened in chunk order."""
        inputs = StepInputs([], [], [], [], [])
        for c in so.chunks:
            end = c.start + c.num_new_tokens
            inputs.input_ids.extend(c.request.all_token_ids[c.start:end])
            inputs.positions.extend(range(c.start, end))
            inputs.query_lens.append(c.num_new_tokens)
            inputs.seq_lens.append(end)
            inputs.tables.append(c.block_ids)
        row_end = list(itertools.accumulate(inputs.query_lens))
        sampling = [row_end[i] - 1 for i, c in enumerate(so.chunks) if c.samples]
        if sampling:
            inputs.logit_rows.append(sampling)
        for i, c in enumerate(so.chunks):
            span = prompt_logprob_span(c.request, c.start, c.num_new_tokens) if c.request.wants_prompt_logprobs \
                else None
            if span is not None:
                offset = row_end[i] - c.num_new_tokens - c.start   # hidden row of position p: offset + p
                for s in range(span[0], span[1], PROMPT_LOGITS_ROWS):
                    inputs.logit_rows.append(list(range(offset + s, offset + min(s + PROMPT_LOGITS_ROWS, span[1]))))
        return inputs

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Serve pure decode steps of up to ``max_num_seqs`` sequences from :class:`DecodeGraphs` (captured now
        with ``capture``; without, the same static-buffer path runs eagerly: the CPU tests)."""
        self.graphs = DecodeGraphs(self._forward_metas, self.layout, self.block_size, max_num_seqs, max_model_len,
                                   self.device, capture, self.platform)
        with torch.inference_mode():
            try:
                self.graphs.capture_all()
            except CaptureRefused as exc:   # a forward a CPU graph cannot replay: every step runs eagerly
                self.graphs = None
                logger.info("decode steps run eagerly: %s", exc)

    def _forward_metas(self, ids: torch.Tensor, positions: torch.Tensor,
                       metas: list[AttentionMetadata]) -> torch.Tensor:
        return self.model(ids, positions, self._context_of(metas))

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Run this rank's shard over a step: final hidden states ``[T, E]`` (a pure decode step that a captured
        batch size holds replays its graph)."""
        if self.graphs is not None and all(q == 1 for q in inputs.query_lens) \
                and self.graphs.bucket_for(len(inputs.query_lens)) is not None:
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.seq_lens,
                                   self._group_tables(inputs.tables))
        ctx = self._context(inputs.query_lens, inputs.seq_lens, inputs.tables)
        ids = self.platform.to_device(inputs.input_ids, torch.int64, self.device)
        return self.model(ids, self.platform.to_device(inputs.positions, torch.int64, self.device), ctx)

    @torch.inference_mode()
    def worker_step(self, inputs: StepInputs) -> None:
        """A rank other than 0: its part of a step (the forward, and the LM head calls rank 0 makes)."""
        hidden = self.forward(inputs)
        for rows in inputs.logit_rows:
            self.model.compute_logits(_rows(hidden, rows))

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0 (the only rank without tensor parallelism): run the step on every rank, then sample."""
        inputs = self.prepare(so)
        if self.tp.size > 1:
            self.tp.publish(inputs)
        hidden = self.forward(inputs)
        logit_rows = iter(inputs.logit_rows)   # consumed in the order prepare() listed them

        out = ModelRunnerOutput({}, {}, {})
        reqs = [c.request for c in so.chunks if c.samples]
        if reqs:
            logits = self.model.compute_logits(_rows(hidden, next(logit_rows)))
            self._mask_early_stop(logits, reqs)
            apply_grammar_masks(logits, [r.grammar for r in reqs])   # structured output rows only
            # A row without a finite maximum (NaN anywhere, +inf, or nothing left) has no token to sample: that
            # request fails alone, the others sample as usual. Its row is sampled with the others (an arbitrary
            # token id in range, dropped here), so that nothing is read back before the step's one read.
            finite = torch.isfinite(logits.amax(dim=-1))   # [S] bool, on the device
            # penalties need the request's tokens: passed (not copied) for the rows that use them only
            histories = [TokenHistory(r.prompt_token_ids, r.output_token_ids) if r.sampling_params.uses_penalties
                         else None for r in reqs]
            result = sample(logits, [r.sampling_params for r in reqs], [r.generator for r in reqs], histories,
                            finite_checked=True, argmax=self.argmax, platform=self.platform)
            for r, row in zip(reqs, _read_back(finite, result)):
                if not row[0]:
                    out.failed[r.request_id] = self._no_token_reason(r)
                    continue
                token = int(row[1])
                out.sampled[r.request_id] = token
                k = r.sampling_params.logprobs
                if k is not None and result.top_logprobs is not None:
                    width = result.top_logprobs[0].shape[1]
                    out.logprobs[r.request_id] = TokenLogprobs(token, row[2], [int(t) for t in row[3 + width:][:k]],
                                                               row[3:3 + k])
        for c in so.chunks:
            span = prompt_logprob_span(c.request, c.start, c.num_new_tokens) if c.request.wants_prompt_logprobs \
                else None
            if span is not None:
                self._prompt_logprobs(c.request, span, hidden, logit_rows, out)
        if next(logit_rows, None) is not None:
            raise RuntimeError("the step computed fewer logits than StepInputs.logit_rows lists")
        return out

    @staticmethod
    def _no_token_reason(r: Request) -> str:
        """Why a request's logits row had no token to sample: its grammar was complete while ``min_tokens`` still
        forbade stopping, or else the model produced NaN / inf."""
        if r.grammar is not None and r.grammar.is_accepting and r.num_output_tokens < r.sampling_params.min_tokens:
            return (f"structured output: the output matches the whole grammar after {r.num_output_tokens} tokens, "
                    f"so only end of sequence may follow, but min_tokens={r.sampling_params.min_tokens} forbids "
                    "stopping yet; lower min_tokens or drop it")
        return ("the model produced non-finite logits (NaN or inf) for this request; the model's weights or config "
                "are broken")

    def _mask_early_stop(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Below ``min_tokens``, the tokens that would stop the request (``Request.stop_tokens``, the set
        :func:`kv8.engine.scheduler.check_stop` stops on) cannot be sampled (as in vLLM). One indexed write for
        the whole batch, its indices copied without waiting for the device."""
        rows = [i for i, r in enumerate(reqs) if r.num_output_tokens < r.sampling_params.min_tokens and r.stop_tokens]
        if not rows:
            return
        cols = [sorted(reqs[i].stop_tokens) for i in rows]
        index = self.platform.to_device([[i for i, c in zip(rows, cols) for _ in c], [t for c in cols for t in c]],
                                        torch.int64, logits.device)
        logits[index[0], index[1]] = float("-inf")

    def _prompt_logprobs(self, req: Request, span: tuple[int, int], hidden: torch.Tensor,
                         logit_rows: Iterator[list[int]], out: ModelRunnerOutput) -> None:
        """Score prompt tokens ``first+1 .. last`` (``span``, from :func:`prompt_logprob_span`): position ``p``'s
        logits predict token ``p + 1``; the hidden rows come from ``logit_rows``, a batch at a time."""
        first, last = span
        k = req.sampling_params.prompt_logprobs or 0
        targets = torch.tensor(req.prompt_token_ids[first + 1:last + 1], device=self.device)
        chunk: list[TokenLogprobs] = []
        for s in range(0, last - first, PROMPT_LOGITS_ROWS):
            logits = self.model.compute_logits(_rows(hidden, next(logit_rows)))
            if self.observer is not None:
                self.observer.on_prompt_logits(req.request_id, first + s, logits)
            lp, top_v, top_i = compute_logprobs(logits, targets[s:s + PROMPT_LOGITS_ROWS], k)
            chunk.extend(_to_token_logprobs(targets[s:s + PROMPT_LOGITS_ROWS], lp, top_v, top_i, j, k)
                         for j in range(logits.shape[0]))
        out.prompt_logprobs[req.request_id] = chunk
