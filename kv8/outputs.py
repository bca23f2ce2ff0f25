"""What the engine returns, shaped like vLLM's ``RequestOutput`` so user code ports unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """Log probability of one token; ``rank`` is 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> its Logprob (the chosen token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None       # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it
    error: str | None = None               # with finish_reason "error": why this sequence alone failed

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
