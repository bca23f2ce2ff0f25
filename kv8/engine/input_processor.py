"""From a user's prompt and :class:`SamplingParams` to the engine requests that will run.

The input processor is where a request enters the engine, so it is where a request is checked: the prompt
(non-empty text, or token ids inside the vocabulary), its length against ``max_model_len``, and the sampling
options that need the model (``logprobs`` / ``prompt_logprobs`` at most the vocabulary size, ``stop_token_ids``
and ``logit_bias`` ids inside it, a ``structured_outputs`` grammar that compiles). ``SamplingParams``
validated everything else at construction; nothing downstream checks again.

A request with ``n`` samples becomes ``n`` :class:`Request`s sharing the prompt and the (frozen) params;
sample ``i`` is seeded with ``seed + i``, or from the engine's generator when ``seed`` is None. Their outputs
are grouped back into one ``RequestOutput`` by :mod:`kv8.engine.output_processor`.

Thread safety: the tokenizer is used only by the thread that drives the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kv8.engine.config import EngineConfig
from kv8.engine.request import Request
from kv8.engine.sampler import make_generator
from kv8.engine.structured import GrammarCompiler
from kv8.sampling_params import SamplingParams
from kv8.validators import is_int


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, device: torch.device | str = "cpu") -> None:
        """``device``: where the requests' generators draw their noise (the engine's, where the logits are)."""
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.vocab_size = config.arch.vocab_size
        self.max_model_len = config.scheduler.max_model_len
        self.generator = torch.Generator().manual_seed(config.seed)   # seeds of requests without a seed
        self.eos_token_ids = frozenset(config.arch.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, sorted(self.eos_token_ids))

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids; ``ValueError`` if unusable."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.vocab_size
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]!r}, not token ids in [0, {vocab})")
        return None, ids

    def process(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[str | None, list[int]]:
        """The prompt text (None for token ids) and token ids of a request that can run.

        Raises ``ValueError`` (naming the field, the value and what is allowed) for a request that can never
        run.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name} must be <= the vocabulary size {self.vocab_size}, got {k}")
        for name, ids in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias or {})):
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise ValueError(f"{name} contains {outside[:5]!r}, not token ids in [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        text, ids = self.tokenize(prompt)
        max_len = self.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_model_len={max_len} at most "
                             f"{max_len - 1} fit (one more is needed for the first generated token)")
        return text, ids

    def make_requests(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> list[Request]:
        """The ``params.n`` requests of one user request (ids ``{request_id}-{i}`` when ``n > 1``), from the
        output of :meth:`process`."""
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        spec = params.structured_outputs
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            children.append(Request(
                request_id=f"{request_id}-{i}" if params.n > 1 else request_id,
                prompt_token_ids=prompt_token_ids, sampling_params=params,
                generator=make_generator(seed, self.generator, self.device), max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids, parent_id=request_id, index=i,
                grammar=None if spec is None else self.grammars.matcher(spec)))
        return children
