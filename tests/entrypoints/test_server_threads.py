"""The server's tokenization is thread safe: worker threads tokenize prompts with the server's own tokenizer
while the engine thread decodes with the engine's, and the engine's tokenizer is touched by no other thread.

In process and bounded: one tiny engine, 4 worker threads x 20 completion + chat tokenizations, while the
engine thread generates (with logprobs, so it decodes at every step). No sockets.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from kv8 import SamplingParams
from kv8.engine.args import EngineArgs
from kv8.engine.async_engine import AsyncEngine, OutputMailbox
from kv8.engine.engine import LLMEngine
from kv8.entrypoints.openai.metrics import ServerMetrics
from kv8.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kv8.entrypoints.openai.serving import OpenAIServing, ServingLimits
from kv8.loader.tokenizer import load_tokenizer

NUM_THREADS, ITERATIONS, DEADLINE_S = 4, 20, 120.0
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France,",
           "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.", "Once upon a time " * 8]


class _ThreadRecorder:
    """Stands in for a fast tokenizer's Rust backend (``_tokenizer``) and records which threads use it."""

    def __init__(self, backend: Any) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "threads", set())

    def __getattr__(self, name: str) -> Any:
        self.threads.add(threading.current_thread().name)
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.threads.add(threading.current_thread().name)
        setattr(self._backend, name, value)


def test_server_tokenizes_with_its_own_tokenizer_while_the_engine_decodes(tiny_llama: str) -> None:
    engine = LLMEngine(EngineArgs(model=tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=256,
                                  max_num_seqs=4))
    oracle = load_tokenizer("hf", tiny_llama)
    expected = {p: oracle.encode(p) for q in PROMPTS for p in (q, q[:7])}
    expected_chat = {p: list(oracle.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                                        add_generation_prompt=True)["input_ids"]) for p in PROMPTS}
    recorder = _ThreadRecorder(engine.tokenizer._tokenizer)
    engine.tokenizer._tokenizer = recorder
    limits = ServingLimits(served_model_name="tiny", max_model_len=256, max_tokens=256, max_n=4, max_in_flight=64,
                           kv_capacity_tokens=64 * 16, kv_block_size=16)
    done_ids: list[str] = []

    def hammer(serving: OpenAIServing, k: int) -> None:
        for i in range(ITERATIONS):
            p = PROMPTS[(k + i) % len(PROMPTS)]
            subs, _ = serving._completion_subs(CompletionRequest(model="tiny", prompt=[p, p[:7]], max_tokens=2))
            assert subs[0].prompt_ids == expected[p] and subs[1].prompt_ids == expected[p[:7]]
            sub = serving._chat_sub(ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": p}]))
            assert sub.prompt_ids == expected_chat[p]

    async def scenario() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            serving = OpenAIServing(async_engine, limits, ServerMetrics())
            assert serving.tokenizer.tokenizer is not engine.tokenizer
            params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=24, ignore_eos=True, logprobs=2)
            mailbox = OutputMailbox()
            hammering = asyncio.gather(*(asyncio.to_thread(hammer, serving, k) for k in range(NUM_THREADS)))
            added = 0
            while not hammering.done():   # keep the engine decoding for as long as the threads tokenize
                await async_engine.add(f"r{added}", expected[PROMPTS[added % len(PROMPTS)]], params, mailbox)
                added += 1
                await asyncio.sleep(0.02)
            await hammering
            while len(done_ids) < added:
                for rid, out in await mailbox.get_all():
                    assert not isinstance(out, BaseException), out
                    if out.finished:
                        done_ids.append(rid)
        finally:
            async_engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert done_ids
    # The engine's tokenizer was used by the engine thread (it decoded) and by nothing else after start.
    assert "kv8-engine" in recorder.threads
    assert recorder.threads <= {"kv8-engine", "MainThread"}, recorder.threads
    assert not engine.has_unfinished_requests()
    engine.kv_manager.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
