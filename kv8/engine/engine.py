"""The engine: composes the input processor, the scheduler, the model runner and the output processor.

Life of a request::

    add_request   InputProcessor              validate, tokenize, fan n > 1 out into n Requests
                  OutputProcessor.add_request  remember the group (one RequestOutput per user request)
                  Scheduler.add                queue each Request
    step          Scheduler.schedule          which tokens to compute; each chunk carries its block table
                  ModelRunner.execute         one forward pass over the chunks, sampling
                  Scheduler.update            append tokens, apply token stop rules (check_stop), free blocks
                  OutputProcessor             detokenize, stop strings, logprob dicts, RequestOutputs

``step`` returns a cumulative :class:`RequestOutput` for every user request that got a token. Invariant: a
user request is known to the output processor from ``add_request`` until its output is ``finished`` or it is
aborted; its requests hold KV blocks only while the scheduler has them waiting or running.

With ``tensor_parallel_size = N > 1`` this engine is rank 0: it starts ranks 1..N-1
(:func:`kv8.engine.worker.start_ranks`), loads its own shard (:func:`kv8.engine.worker.load_shard`, which the
workers run too), waits for theirs, and drives them: each step's inputs go to every rank, rank 0 alone samples
(:mod:`kv8.engine.runner`). :meth:`LLMEngine.shutdown` (also run when the engine is garbage collected or the
process exits) stops them.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from kv8.cache.kv_cache_manager import KVCacheManager
from kv8.engine.args import EngineArgs
from kv8.engine.config import EngineConfig
from kv8.engine.input_processor import InputProcessor
from kv8.engine.output_processor import OutputProcessor
from kv8.engine.request import RequestStatus
from kv8.engine.scheduler import Scheduler, SchedulerOutput
from kv8.engine.stats import EngineStats
from kv8.engine.threads import ThreadGovernor
from kv8.engine.worker import allreduce_slot_bytes, load_shard, start_ranks
from kv8.loader.model import check_checkpoint_layers, read_model_config
from kv8.loader.sources import resolve_model_path
from kv8.loader.tokenizer import load_tokenizer
from kv8.observer import EngineObserver
from kv8.outputs import RequestOutput
from kv8.sampling_params import SamplingParams
from kv8.validators import format_bytes

logger = logging.getLogger("kv8")


class LLMEngine:
    """Owns the model, the KV cache and the four parts above. Not thread safe: one thread drives it."""

    def __init__(self, args: EngineArgs, observer: EngineObserver | None = None) -> None:
        kind, path = resolve_model_path(args.model)
        # Validate every option against the architecture before paying for the weights.
        self.config: EngineConfig = args.create_engine_config(read_model_config(kind, path), kind, path)
        if self.config.load_format != "dummy":   # before anything is sized by the layer count
            check_checkpoint_layers(kind, path, self.config.arch)
        budget = self.config.kv_budget()
        self.layout = budget.layout
        num_blocks = budget.num_blocks()   # a budget too small for max_model_len fails here
        if observer is not None and self.config.parallel.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.config.parallel.tensor_parallel_size}: an observer (kv8 "
                             "calibrate, kv8 eval) would see rank 0's KV heads only; run these tools with "
                             "tensor_parallel_size=1")
        # ranks 1..N-1 (started now, or joined under torchrun)
        self.tp = start_ranks(args, self.config, num_blocks)
        self._finalizer = weakref.finalize(self, self.tp.close)   # no orphan ranks, whatever happens
        try:
            shard = load_shard(self.config, budget, num_blocks, self.tp, observer)
            self.tp.wait_ready()
            self.tp.connect(slot_bytes=allreduce_slot_bytes(self.config), platform=self.config.platform)
        except BaseException:
            self.shutdown()
            raise
        self.dense_backend = shard.loaded.dense_backend
        self.model = shard.loaded.model
        self.tokenizer = load_tokenizer(kind, path)
        self.caches = shard.caches
        self.cache = self.caches[0]   # the first pool: kv_cache_dtype's (the only one without a plan or skipped layers)
        cc = self.config.cache
        self.kv_manager = KVCacheManager(self.layout, num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_manager)
        self.runner = shard.runner
        self.backend = self.runner.backend
        self.input_processor = InputProcessor(self.config, self.tokenizer, self.runner.device)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._last_schedule: SchedulerOutput | None = None   # what the last step computed (stats())
        # one rank: follow the cores other processes leave free (the first reading now, the next at a step)
        self.governor = ThreadGovernor(torch.get_num_threads()) \
            if self.tp.size == 1 and self.config.parallel.adaptive_cpu_threads else None
        if self.governor is not None:
            self.governor.idle()
        per_rank = f" per rank ({self.tp.size} tensor-parallel ranks)" if self.tp.size > 1 else ""
        specs = [s.describe() for s in budget.plan.specs]
        logger.info(
            "KV cache on %s: dtype %s, %s blocks of %d tokens, %s in all%s; %s; %s; prefix caching %s; attention "
            "backend %s; dense backend %s", self.runner.device, cc.default_spec.name, " + ".join(map(str, num_blocks)),
            cc.block_size,
            format_bytes(sum(c.nbytes for c in self.caches)), per_rank, self.layout.describe(specs),
            "; ".join(f"{specs[p.spec]}: {c.codec.describe()}" for p, c in zip(self.layout.pools, self.caches)),
            "on" if cc.enable_prefix_caching else "off", self.backend.name, self.dense_backend)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this engine started (nothing to do with one rank). Idempotent."""
        self._finalizer()

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` for a prompt that can never run."""
        text, ids = self.input_processor.process(prompt, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = self.input_processor.make_requests(ids, params, request_id)
        self.output_processor.add_request(request_id, text, children)
        for child in children:
            self.scheduler.add(child)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks now. Returns False if it is unknown or already done."""
        children = self.output_processor.abort_request(request_id)
        if children is None:
            return False
        for child in children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> update; then the requests' new text and their outputs."""
        if self.governor is None:
            return self._step()
        self.governor.observe()
        try:
            return self._step()
        finally:
            self.governor.idle()

    def _step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        self._last_schedule = so
        if so.is_empty:
            return []
        updated = self.scheduler.update(so, self.runner.execute(so))
        for req in self.output_processor.detokenize(updated):   # the requests a stop string ended
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        return self.output_processor.make_outputs(updated)

    def run_to_completion(self, request_ids: Sequence[str],
                          on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Step until every request of ``request_ids`` (added with :meth:`add_request`) has finished, and return
        their final outputs in that order. ``on_output`` sees every output of every step as it comes (streaming,
        progress, timing), other requests' too. Whatever ends the loop early -- an exception in a step or in
        ``on_output``, a KeyboardInterrupt -- aborts the requests of ``request_ids`` that have not finished, so
        the engine holds none of them afterwards. ``ValueError`` for an id that is not in flight."""
        unknown = [rid for rid in request_ids if rid not in self.output_processor.groups]
        if unknown:
            raise ValueError(f"request ids not in flight: {', '.join(map(repr, unknown))}")
        done: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        try:
            while len(done) < len(wanted):
                for out in self.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                    if on_output is not None:
                        on_output(out)
        finally:
            for rid in request_ids:
                if rid not in done:
                    self.abort_request(rid)
        return [done[rid] for rid in request_ids]

    # ---- introspection --------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's state (:class:`EngineStats`)."""
        so = self._last_schedule
        chunks = so.chunks if so is not None else ()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_prefilling=sum(r.num_tokens - r.num_computed_tokens > 1 for r in self.scheduler.running),
            kv_cache_usage=self.kv_manager.usage, num_free_blocks=self.kv_manager.num_free_blocks,
            num_blocks=self.kv_manager.num_blocks, block_size=self.config.cache.block_size,
            prefix_cache_hit_rate=self.kv_manager.prefix_cache_hit_rate(), prefix_cache_hits=self.kv_manager.num_hits,
            prefix_cache_queries=self.kv_manager.num_queries, num_preemptions=self.scheduler.num_preemptions,
            last_step_prefill_tokens=sum(c.num_new_tokens for c in chunks if c.num_new_tokens > 1),
            last_step_decode_tokens=sum(c.num_new_tokens == 1 for c in chunks))
