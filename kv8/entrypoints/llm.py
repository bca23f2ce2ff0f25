"""``LLM``: the offline Python API, named like vLLM's so user code ports unchanged.

``LLM`` composes an :class:`LLMEngine` (it does not inherit from it): ``generate`` queues every prompt,
steps the engine until all are done and returns one :class:`RequestOutput` per prompt, in prompt order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kv8.engine.args import DEFAULT_MODEL, EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.engine.worker import run_torchrun_worker
from kv8.outputs import RequestOutput
from kv8.sampling_params import SamplingParams

Prompt = str | Sequence[int] | dict[str, Any]


def _is_token_ids(x: object) -> bool:
    """A sequence of ints (bools excluded); range checks are the engine's."""
    return isinstance(x, Sequence) and not isinstance(x, str) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """A string, a list of token ids, ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}`` or a list of these."""
    items: Sequence[Any]
    if isinstance(prompts, (str, dict)):
        items = [prompts]
    elif _is_token_ids(prompts) and prompts:
        items = [list(prompts)]
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        items = prompts
    else:
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of these; got "
                         f"{type(prompts).__name__}")
    out: list[str | list[int]] = []
    for i, p in enumerate(items):
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                p = p["prompt_token_ids"]
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError(f"prompts[{i}] is a dict without 'prompt' or 'prompt_token_ids'")
        if isinstance(p, str):
            out.append(p)
        elif _is_token_ids(p):
            out.append(list(p))
        else:
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
    return out


class LLM:
    """An LLM with a paged, optionally FP8, KV cache.

    >>> llm = LLM(model="smollm2-135m", kv_cache_dtype="fp8")            # doctest: +SKIP
    >>> llm.generate("London is the capital of")[0].outputs[0].text      # doctest: +SKIP

    Keyword arguments are the fields of :class:`~kv8.engine.args.EngineArgs` (vLLM's names, the same options as
    the ``kv8`` flags); ``print(EngineArgs.describe())`` lists them with defaults, allowed values and help.
    With ``tensor_parallel_size=N`` the engine starts N-1 worker processes: :meth:`close` stops them (so does
    garbage collection of the LLM, or the end of the process). Under torchrun every process runs the same script:
    on ranks 1..N-1 ``LLM(...)`` serves rank 0's steps and then ends the process (``SystemExit(0)``) once rank 0
    stops, so the script's code after it runs on rank 0 alone (:func:`kv8.engine.worker.run_torchrun_worker`).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(f"LLM() got unknown option(s) {', '.join(unknown)}; known: "
                            f"{', '.join(EngineArgs.field_names())}")
        args = EngineArgs(model=model, **kwargs)
        if run_torchrun_worker(args):   # a torchrun rank other than 0: it served rank 0 until it stopped
            raise SystemExit(0)
        self.engine = LLMEngine(args)
        self._counter = 0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes, if any (idempotent)."""
        self.engine.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; one output per prompt, in order."""
        items = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts; pass one, or one "
                                 "per prompt")
        return self._run(items, params, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        convs: list[Any] = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[Prompt] = [self.chat_prompt_ids(conv, add_generation_prompt) for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_ids(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of one conversation through the tokenizer's chat template (what :meth:`chat` runs)."""
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        ids: Any = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _run(self, items: list[str | list[int]], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        ids = []
        try:
            for item, p in zip(items, params):
                ids.append(self.engine.add_request(item, p, request_id=f"gen-{self._counter}"))
                self._counter += 1
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        try:
            return self.engine.run_to_completion(ids, lambda out: bar.update(1) if out.finished else None)
        finally:
            bar.close()
