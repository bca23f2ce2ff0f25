"""What one step of the model runner returns to the scheduler: :class:`ModelRunnerOutput` (its own module, so
that the scheduler, which applies it, and the runner, which makes it, import it from below both)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv8.engine.request import TokenLogprobs


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results, keyed by request id (only the requests that produced something appear)."""

    sampled: dict[str, int]                              # request id -> new token id
    logprobs: dict[str, TokenLogprobs]                   # request id -> logprobs of the new token (if asked)
    prompt_logprobs: dict[str, list[TokenLogprobs]]      # request id -> logprobs of prompt tokens scored this step
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it cannot go on (it alone fails)
