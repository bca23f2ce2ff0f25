"""The engine: requests in, steps of the scheduler and the model, outputs out.

Life of a request: ``add_request`` tokenizes and validates it and fans ``n > 1`` out into ``n`` child
requests (sample ``i`` seeded with ``seed + i``); each ``step`` asks the scheduler which tokens to compute,
the runner computes them and samples, and the engine appends sampled tokens, detokenizes, checks the stop
conditions and frees the blocks of finished requests. ``step`` returns a :class:`RequestOutput` for every
request that changed.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kv8.attention.backend import get_backend
from kv8.cache.codec import KVCodec
from kv8.cache.kv_cache_manager import KVCacheManager
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.config import EngineConfig, format_bytes
from kv8.engine.args import EngineArgs, resolve_num_blocks
from kv8.engine.detokenizer import IncrementalDetokenizer, find_stop
from kv8.engine.request import Request, RequestStatus, TokenLogprobs
from kv8.engine.runner import ModelRunner, ModelRunnerOutput
from kv8.engine.sampler import make_generator
from kv8.engine.scheduler import Scheduler, SchedulerOutput
from kv8.model.loader import load_model, read_model_config
from kv8.model.sources import resolve_model_path
from kv8.model.tokenizer import load_tokenizer
from kv8.observer import EngineObserver
from kv8.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kv8.quant.scales import ModelScaleInfo, resolve_kv_scales, scales_from_checkpoint
from kv8.sampling_params import SamplingParams

logger = logging.getLogger("kv8")


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]


class LLMEngine:
    def __init__(self, args: EngineArgs, observer: EngineObserver | None = None) -> None:
        kind, path = resolve_model_path(args.model)
        # Validate every option against the architecture before paying for the weights.
        self.config: EngineConfig = args.create_engine_config(read_model_config(kind, path), kind, path)
        loaded = load_model(kind, path, self.config.dtype, self.config.dense_backend)
        self.dense_backend = loaded.dense_backend
        self.model = loaded.model
        self.tokenizer = load_tokenizer(kind, path)
        arch, cc = self.config.arch, self.config.cache
        info = ModelScaleInfo(arch.model_type, arch.num_layers, arch.num_kv_heads, arch.head_dim)
        ckpt = scales_from_checkpoint(loaded.scale_tensors, loaded.hf_config, info) if loaded.scale_tensors else None
        if cc.dynamic_scales:
            scales = None
            if ckpt is not None:
                logger.info("dynamic KV scales: the checkpoint's static scales (%s) are not used", ckpt.source)
        else:
            scales = resolve_kv_scales(cc.kv_dtype, info, cc.quantization_param_path, ckpt, cc.rotation)
        codec = KVCodec.build(cc.kv_dtype, arch.head_dim, scale_mode=cc.scale_mode, rotation=cc.rotation,
                              scales=scales)
        num_blocks = resolve_num_blocks(self.config)
        self.cache = PagedKVCache(CacheShape(arch.num_layers, num_blocks, arch.num_kv_heads, cc.block_size,
                                             arch.head_dim), codec)
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        self.backend = get_backend(self.config.attention_backend)
        self.runner = ModelRunner(self.model, self.cache, self.kv, self.backend, observer)
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.eos_token_ids = frozenset(arch.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.parents: dict[str, _Parent] = {}
        self._ids = itertools.count()
        self.last_schedule: SchedulerOutput | None = None
        per_token = arch.kv_bytes_per_token(cc.kv_dtype, cc.dynamic_scales)
        logger.info(
            "KV cache: dtype %s, %d blocks of %d tokens = %d tokens, %s per token, %s in all; %s; "
            "prefix caching %s; attention backend %s; dense backend %s",
            cc.kv_dtype.name, num_blocks, cc.block_size, num_blocks * cc.block_size, format_bytes(per_token),
            format_bytes(self.cache.nbytes), codec.describe(),
            "on" if cc.enable_prefix_caching else "off", self.backend.name, self.dense_backend)

    # ---- requests -------------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.config.arch.vocab_size
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]!r}, not token ids in [0, {vocab})")
        return None, ids

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` for a prompt that can never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        max_len = self.config.scheduler.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_model_len={max_len} at most "
                             f"{max_len - 1} fit (one more is needed for the first generated token)")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        room = max_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        children, detoks = [], []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            children.append(Request(
                request_id=f"{request_id}-{i}" if params.n > 1 else request_id,
                prompt_token_ids=ids, sampling_params=params,
                generator=make_generator(seed, self.generator), max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids, prompt=text, parent_id=request_id, index=i))
            detoks.append(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
        self.parents[request_id] = _Parent(request_id, text, ids, children, detoks)
        for child in children:
            self.scheduler.add(child)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks now. Returns False if it is unknown or already done."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return False
        for child in parent.children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        self.last_schedule = so  # what the step computed (read by benchmarks and tools)
        if so.is_empty:
            return []
        result = self.runner.execute(so)
        self.scheduler.advance(so)
        touched: dict[str, _Parent] = {}
        for chunk in so.chunks:
            req = chunk.request
            parent = self.parents[req.parent_id or req.request_id]
            if self._apply(req, parent, result):
                touched[parent.request_id] = parent
        outputs = [self._make_output(p) for p in touched.values()]
        for out in outputs:
            if out.finished:
                del self.parents[out.request_id]
        return outputs

    def _apply(self, req: Request, parent: _Parent, result: ModelRunnerOutput) -> bool:
        rid = req.request_id
        if rid in result.prompt_logprobs:
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            req.prompt_logprobs.extend(result.prompt_logprobs[rid])
        if rid not in result.sampled:
            return False
        token = result.sampled[rid]
        req.append_output_token(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if rid in result.logprobs:
            req.logprobs.append(result.logprobs[rid])
            req.cumulative_logprob += result.logprobs[rid].logprob
        detok = parent.detokenizers[req.index]
        delta = detok.add(token)
        status = self._check_stop(req, token, delta)
        if status is not None:
            if status != RequestStatus.FINISHED_STOPPED or not isinstance(req.stop_reason, str):
                req.text += detok.flush()
            self.scheduler.finish(req, status)
        return True

    def _check_stop(self, req: Request, token: int, delta: str) -> RequestStatus | None:
        p = req.sampling_params
        req.text += delta
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if p.stop and delta:
                hit = find_stop(req.text, len(delta), p.stop)
                if hit is not None:
                    idx, stop = hit
                    req.text = req.text[:idx + len(stop)] if p.include_stop_str_in_output else req.text[:idx]
                    req.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- outputs --------------------------------------------------------------------------------------------
    def _position_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        entry: PositionLogprobs = {}
        for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            entry[tid] = Logprob(val, rank, self.tokenizer.decode([tid]))
        if lp.token_id not in entry:
            # rank of the chosen token among all: 1 + number of top entries strictly above it (>= when not listed)
            rank = 1 + sum(v > lp.logprob for v in lp.top_logprobs) if lp.top_logprobs else None
            entry[lp.token_id] = Logprob(lp.logprob, rank, self.tokenizer.decode([lp.token_id]))
        return entry

    def _converted(self, raw: list[TokenLogprobs | None], done: list[PositionLogprobs | None]
                   ) -> list[PositionLogprobs | None]:
        """``raw`` as output dicts; ``done`` caches the positions converted at earlier steps, so each position is
        detokenized once, not at every step that reports the request."""
        done.extend(None if x is None else self._position_logprobs(x) for x in raw[len(done):])
        return list(done)

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs = []
        for req in parent.children:
            p = req.sampling_params
            status = req.status.value if req.is_finished else None
            outs.append(CompletionOutput(
                index=req.index, text=req.text, token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if p.logprobs is not None else None,
                logprobs=self._converted(req.logprobs, req.logprob_dicts) if p.logprobs is not None else None,
                finish_reason=status, stop_reason=req.stop_reason))
        first = parent.children[0]
        prompt_lps = None
        if first.sampling_params.prompt_logprobs is not None:
            prompt_lps = self._converted(first.prompt_logprobs, first.prompt_logprob_dicts)
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_lps, outputs=outs, finished=all(r.is_finished for r in parent.children),
            num_cached_tokens=first.num_cached_prompt_tokens)

    # ---- introspection --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv.pool.usage,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_blocks": self.kv.pool.num_blocks,
            "prefix_cache_hit_rate": self.kv.prefix_cache_hit_rate(),
            "num_preemptions": self.scheduler.num_preemptions,
        }

