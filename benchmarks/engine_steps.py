"""What the engine benchmarks time the same way (``bench_engine_step.py``, ``bench_tp.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from kv8 import SamplingParams
from kv8.engine.engine import LLMEngine


def time_prefill_step(eng: LLMEngine, prompt: Callable[[], list[int]], request_ids: Iterator[int],
                      prompts: int = 4) -> float:
    """Seconds of the one engine step that prefills ``prompts`` fresh prompts from ``prompt()`` (each asks for one
    token); the engine is then run until it is idle again, untimed."""
    for _ in range(prompts):
        eng.add_request(prompt(), SamplingParams(temperature=0, max_tokens=1), request_id=f"p{next(request_ids)}")
    start = time.perf_counter()
    eng.step()
    elapsed = time.perf_counter() - start
    # a hand loop, not run_to_completion: bench_engine_step.py --before runs this against revisions older than it
    while eng.has_unfinished_requests():
        eng.step()
    return elapsed


def until_first_tokens(eng: LLMEngine, request_ids: list[str]) -> None:
    """Step the engine until every request of ``request_ids`` has its first token (its prompt is in the cache), so
    that the next steps decode them."""
    waiting = set(request_ids)
    while waiting:
        waiting.difference_update(out.request_id for out in eng.step() if out.outputs[0].token_ids)
