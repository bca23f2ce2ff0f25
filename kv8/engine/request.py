"""One sequence being generated, and its life cycle.

A :class:`Request` owns its tokens (prompt then outputs) and ``num_computed_tokens``: how many of them have
their K/V in the cache. The scheduler moves ``num_computed_tokens`` towards ``num_tokens`` a chunk at a time
("schedule tokens, not phases"), so prefill, chunked prefill, decode and recompute after preemption are one
mechanism. A user request with ``n > 1`` becomes ``n`` of these (see :mod:`kv8.engine.input_processor`).

Text is not kept here: the output processor (:mod:`kv8.engine.output_processor`) owns detokenized text and
the logprob dicts handed to users.

Invariants: ``0 <= num_computed_tokens <= num_tokens``; a request samples a new token in a step exactly when
that step brings ``num_computed_tokens`` to ``num_tokens``; ``all_token_ids == prompt_token_ids +
output_token_ids``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kv8.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kv8.engine.structured import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"     # this request alone failed (e.g. the model gave it non-finite logits)

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass
class TokenLogprobs:
    """Logprobs of one position: the chosen token's, and the top-k alternatives (ids and values)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Request:
    """One sequence. ``max_tokens`` is the effective limit (``SamplingParams.max_tokens`` capped by the room
    left in ``max_model_len``); ``eos_token_ids`` are the model's end-of-sequence tokens."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator
    max_tokens: int
    eos_token_ids: frozenset[int]
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
    error: str | None = None   # why the request failed (status FINISHED_ERROR)
    cumulative_logprob: float = 0.0
    # structured output: has consumed exactly output_token_ids (kept across preemption, as those tokens are)
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        p = self.sampling_params
        # The one definition of "which tokens stop": EOS (unless ignore_eos) and stop_token_ids. They end the
        # request once it has min_tokens outputs (scheduler.check_stop) and cannot be sampled before (the
        # runner masks them).
        self.stop_tokens: frozenset[int] = frozenset(p.stop_token_ids or ()) | (
            frozenset() if p.ignore_eos else self.eos_token_ids)

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
