"""Continuous batching: which requests advance by how many tokens in the next step.

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, in arrival order: each
asks for all its uncomputed tokens (1 for a decode, the rest of its prompt for a chunked prefill) up to the
remaining budget. When the block pool cannot supply a running request, the newest running request is
preempted -- its blocks freed, its progress reset, and it goes back to the front of the queue to be
recomputed (its cached prefix blocks usually make that cheap). Then, if nothing was preempted, waiting
requests are admitted (prefix hits first) while budget, ``max_num_seqs`` and free blocks allow, keeping
enough free blocks in reserve for every running request to grow by ``GROWTH_RESERVE_TOKENS`` tokens after this
step's, or to its last possible token (prompt + ``max_tokens``) where that comes sooner, at most a quarter of the
pool (a watermark, so that admitting a prompt does not soon force the preemption of a decoding request, whose
recompute would waste the work done; measured with ``benchmarks/bench_serving.py``: a reserve of 64 tokens
instead of one block cut the recomputed tokens by a quarter and total time by 3-10%). A request never reserves
blocks it cannot fill: in a pool sized for exactly its requests' final lengths, 8 prompts of 1,024 tokens with 32
new each, a reserve of 64 tokens per request kept the eighth prompt waiting until the other seven had finished.

The scheduler side also owns the request state that follows from a step: :meth:`Scheduler.update` records
the computed tokens, appends each sampled token and its logprobs, and ends requests by :func:`check_stop`, the
one place that applies the token-level stop rules (EOS, stop token ids, ``min_tokens``, ``max_tokens``).
Stop strings need text and belong to the output processor.

Invariants: a request whose tokens fit in ``max_model_len`` always fits in empty pools (the engine refuses
pools smaller than one ``max_model_len`` sequence needs, counting sliding-window groups at their window), so
preemption always makes progress: no crash, no hang. Each
:class:`ScheduledChunk` carries its request's block table as allocated for that step, so the runner needs no
access to the KV cache manager.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kv8.cache.kv_cache_manager import KVCacheManager
from kv8.engine.config import SchedulerConfig
from kv8.engine.request import Request, RequestStatus
from kv8.engine.runner_output import ModelRunnerOutput

GROWTH_RESERVE_TOKENS = 64  # per running request, kept free when admitting (rounded up to whole blocks)


@dataclass(frozen=True)
class ScheduledChunk:
    """``request`` computes tokens ``[start, start + num_new_tokens)`` this step.

    ``block_ids[g]`` is the request's block table in KV cache group ``g`` after this step's allocation: it
    covers at least ``start + num_new_tokens`` tokens (token ``t`` lives in block ``block_ids[g][t //
    block_size]``); in a sliding-window group, entries before the window are ``NULL_BLOCK`` (never read).
    """

    request: Request
    start: int
    num_new_tokens: int
    block_ids: tuple[tuple[int, ...], ...]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes: one chunk per scheduled request (running requests first, then admitted ones),
    and the requests preempted to make room (their blocks are already freed)."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv_manager.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, self._block_ids(req)))
                budget -= n
                i += 1

        kv = self.kv_manager
        # Per pool, the running requests' growth (module docstring), summed when a prompt is first considered (not
        # on the steps that admit nothing). Admission runs only when nothing was preempted and budget is left, so
        # every running request has a chunk this step.
        reserve: list[int] | None = None
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if reserve is None:
                reserve = [0] * len(kv.pools)
                for c in chunks:
                    self._add_growth(reserve, c.request, c.num_new_tokens)
            req = self.waiting[0]
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit_tokens, budget)
            needed = kv.blocks_needed(req, n, hit_blocks)
            if self.running and any(need + min(keep, pool.num_blocks // 4) > pool.num_free_blocks
                                    for need, keep, pool in zip(needed, reserve, kv.pools)):
                break
            if not kv.allocate_slots(req, n, hit_blocks):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, num_hit_tokens, n, self._block_ids(req)))
            budget -= n
            self._add_growth(reserve, req, n)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _add_growth(self, reserve: list[int], request: Request, scheduled: int) -> None:
        """Add to ``reserve`` (per pool) the blocks ``request``, with ``scheduled`` tokens allocated this step,
        would take to grow by ``GROWTH_RESERVE_TOKENS`` more tokens, or to its last possible token if sooner."""
        room = request.num_prompt_tokens + request.max_tokens - request.num_computed_tokens - scheduled
        grow = min(GROWTH_RESERVE_TOKENS, max(room, 0))
        for p, blocks in enumerate(self.kv_manager.blocks_to_grow(request, scheduled + grow)):
            reserve[p] += blocks

    def _block_ids(self, request: Request) -> tuple[tuple[int, ...], ...]:
        # Taken right after the request's allocation succeeded; a preemption later in the same schedule() only
        # takes requests that were not scheduled yet, so the tables stay valid for the whole step.
        return self.kv_manager.block_ids(request.request_id)

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results and return the requests that sampled a token or failed, in chunk order.

        Every chunk's tokens become computed (their full blocks are published to the prefix cache); then each
        sampled token is appended with its logprobs, and a request that :func:`check_stop` ends is finished
        (its blocks freed). Prompt logprobs scored this step are appended as well.
        """
        for chunk in output.chunks:
            chunk.request.num_computed_tokens = chunk.start + chunk.num_new_tokens
            self.kv_manager.cache_computed_blocks(chunk.request)
        updated = []
        for chunk in output.chunks:
            req = chunk.request
            rid = req.request_id
            if rid in result.prompt_logprobs:
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)   # the first prompt token has no logprob
                req.prompt_logprobs.extend(result.prompt_logprobs[rid])
            error = result.failed.get(rid)
            if error is not None:
                req.error = error
                self.finish(req, RequestStatus.FINISHED_ERROR)
                updated.append(req)
                continue
            token = result.sampled.get(rid)
            if token is None:
                continue
            req.append_output_token(token)
            if req.grammar is not None and not req.grammar.accept(token):   # cannot happen: the runner masked
                req.error = f"structured output: token {token} is not allowed by the grammar ({req.grammar.error})"
                self.finish(req, RequestStatus.FINISHED_ERROR)
                updated.append(req)
                continue
            lp = result.logprobs.get(rid)
            if lp is not None:
                req.logprobs.append(lp)
                req.cumulative_logprob += lp.logprob
            status = check_stop(req)
            if status is not None:
                self.finish(req, status)
            updated.append(req)
        return updated

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request (running or waiting) and free its blocks. On a request that is already finished
        this only sets ``status`` (a stop string found in the text of a request that reached ``max_tokens``)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv_manager.free(request)


def check_stop(request: Request) -> RequestStatus | None:
    """The token-level stop rules, applied after a token was appended; None while the request goes on.

    Once the request has ``min_tokens`` outputs, a token in ``request.stop_tokens`` stops it: EOS reports no
    stop reason, a ``stop_token_ids`` hit reports the token (EOS wins when a token is both, unless
    ``ignore_eos``). Otherwise it ends with ``length`` at ``request.max_tokens`` outputs.
    """
    token = request.output_token_ids[-1]
    p = request.sampling_params
    if request.num_output_tokens >= p.min_tokens and token in request.stop_tokens:
        if p.ignore_eos or token not in request.eos_token_ids:
            request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
