"""One sequence being generated, and its life cycle.

A :class:`Request` owns its tokens (prompt then outputs) and ``num_computed_tokens``: how many of them have
their K/V in the cache. The scheduler moves ``num_computed_tokens`` towards ``num_tokens`` a chunk at a time
("schedule tokens, not phases"), so prefill, chunked prefill, decode and recompute after preemption are one
mechanism. A parent request with ``n > 1`` is fanned out into ``n`` of these by the engine.

Invariant: ``0 <= num_computed_tokens <= num_tokens``; a request samples a new token in a step exactly when
that step brings ``num_computed_tokens`` to ``num_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kv8.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class TokenLogprobs:
    """Logprobs of one position: the chosen token's, and the top-k alternatives (ids and values)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator
    max_tokens: int
    eos_token_ids: frozenset[int]
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None
    index: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # The engine's cache of ``logprobs`` / ``prompt_logprobs`` converted to output dicts (``kv8.outputs``).
    logprob_dicts: list = field(default_factory=list)
    prompt_logprob_dicts: list = field(default_factory=list)
    first_token_time: float | None = None
    # Text produced so far (maintained by the engine's detokenizer) and how much of it was already streamed.
    text: str = ""

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
