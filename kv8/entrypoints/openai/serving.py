"""The OpenAI completion, chat-completion and Responses endpoints on top of :class:`AsyncEngine`.

One HTTP request becomes one engine request per prompt (``n`` samples each, fanned out by the engine). Its
outputs are read from a single :class:`OutputMailbox` and turned into OpenAI JSON, either at the end or as
SSE chunks (``data: {...}`` lines, then ``data: [DONE]``). Engine outputs are cumulative, so updates that
arrive while the client is slower than the engine are coalesced into one chunk.

Prompts are tokenized (and chat templates applied) in a worker thread, so that a large prompt does not
stall the other streams on the event loop, with the server's own tokenizer (:class:`ServerTokenizer`: a
second instance behind a lock), never the engine's, which the engine thread uses to decode at every step.
The engine receives token ids only.

Streaming text holds back the last ``len(longest stop string) - 1`` characters until the request finishes,
so that a stop string completed by a later token never has its beginning streamed. A request whose client
goes away (a cancelled streaming generator, or an ``http.disconnect`` while a non-streaming request waits)
is aborted at once: the engine frees its KV blocks before its next step.

Legacy ``logprobs.text_offset`` values are offsets into the concatenation of the returned token strings
(prompt tokens included when ``echo``), as in vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kv8.engine.async_engine import AsyncEngine
from kv8.engine.structured import check_grammar
from kv8.entrypoints.openai.metrics import ServerMetrics
from kv8.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    TokenizeRequest,
)
from kv8.entrypoints.openai.request_run import RequestRun, Stream, SubRequest, sse, usage, visible
from kv8.entrypoints.openai.responses import (
    ResponseEvents,
    ResponsesRequest,
    finish,
    output_items,
    renamed,
    response_object,
)
from kv8.entrypoints.openai.responses import usage as responses_usage
from kv8.entrypoints.openai.tokenizer import ServerTokenizer
from kv8.entrypoints.openai.tool_calling import ToolCallStream, ToolOptions, ToolPlan, plan_tools
from kv8.outputs import CompletionOutput, Logprob, PositionLogprobs
from kv8.sampling_params import SamplingParams, StructuredOutputsParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ServingLimits:
    """Per-request limits. Invariant: every field >= 1; ``max_tokens <= max_model_len``."""

    served_model_name: str
    max_model_len: int
    max_tokens: int
    max_n: int
    max_in_flight: int           # sequences accepted and unfinished before new requests get 503
    kv_capacity_tokens: int
    kv_block_size: int


def _sorted_entries(entry: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, kv[0]))


async def _run_to_completion(run: RequestRun, disconnect: Callable[[], Awaitable[object]]) -> None:
    """Drain a non-streamed request's updates until it finishes, aborting it if the client disconnects."""
    watcher = asyncio.ensure_future(disconnect())
    try:
        async for _ in run.updates(watcher):
            pass
    finally:
        watcher.cancel()
        run.close()


class OpenAIServing:
    """The endpoints' logic. ``tokenizer`` defaults to a new :class:`ServerTokenizer` for the engine's model."""

    def __init__(self, engine: AsyncEngine, limits: ServingLimits, metrics: ServerMetrics,
                 tokenizer: ServerTokenizer | None = None, tool_options: ToolOptions | None = None) -> None:
        self.engine = engine
        self.limits = limits
        self.tool_options = tool_options if tool_options is not None else ToolOptions()
        self.metrics = metrics
        self.tokenizer = tokenizer if tokenizer is not None else ServerTokenizer.load(engine.engine.config)
        self.vocab_size = engine.engine.config.arch.vocab_size
        self.in_flight = 0
        self._counter = itertools.count()

    # ---- shared checks --------------------------------------------------------------------------------------
    # ---- /tokenize, /detokenize and /tokenizer_info (vLLM's) ---------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a prompt or a chat, as generation would see them (run in a worker thread)."""
        if req.model is not None:
            self._check_model(req.model)
        if req.prompt is not None:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = self.tokenizer.chat_ids(req.messages or [], req.add_generation_prompt, req.tool_dicts())
        return {"tokens": ids, "count": len(ids), "max_model_len": self.limits.max_model_len}

    def tokenizer_info(self) -> dict[str, Any]:
        """``GET /tokenizer_info`` (vLLM's; lm-evaluation-harness's ``tokenizer_backend=remote`` reads it)."""
        return self.tokenizer.info()

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        if req.model is not None:
            self._check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"tokens contains ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})",
                           param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def _check_model(self, model: str) -> None:
        if model != self.limits.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.limits.served_model_name}`", param="model", code="model_not_found")

    def _check_n(self, n: int) -> None:
        if n > self.limits.max_n:
            raise APIError(400, f"n={n} is above this server's limit of {self.limits.max_n}", param="n")

    def _max_tokens(self, requested: int | None, n_prompt: int, default: int | None, param: str,
                    prompt_param: str) -> int:
        """Generated-token budget; 400 when the prompt (+ requested tokens) cannot fit the context."""
        lim = self.limits
        where = (f"(the KV cache holds {lim.kv_capacity_tokens} tokens in blocks of {lim.kv_block_size}; "
                 f"max_model_len is {lim.max_model_len})")
        if n_prompt >= lim.max_model_len:
            raise APIError(400, f"This model's maximum context length is {lim.max_model_len} tokens, but the "
                                f"prompt has {n_prompt} tokens: at most {lim.max_model_len - 1} fit, leaving room "
                                f"for one generated token {where}", param=prompt_param,
                           code="context_length_exceeded")
        if requested is not None and requested > lim.max_tokens:
            raise APIError(400, f"{param}={requested} is above this server's limit of {lim.max_tokens}",
                           param=param)
        if requested is None:
            return min(default if default is not None else lim.max_tokens, lim.max_model_len - n_prompt)
        if n_prompt + requested > lim.max_model_len:
            raise APIError(400, f"This model's maximum context length is {lim.max_model_len} tokens, but "
                                f"{n_prompt + requested} were requested ({n_prompt} in the prompt, {requested} for "
                                f"the completion) {where}", param=param, code="context_length_exceeded")
        return requested

    def _release(self, num_seqs: int) -> None:
        self.in_flight -= num_seqs

    def _admit(self, subs: list[SubRequest], request_id: str, route: str) -> RequestRun:
        """The run of ``subs``, the engine requests of the HTTP request ``request_id`` to ``route`` (a path);
        a 503 when the server holds too many sequences to take them."""
        num_seqs = sum(s.params.n for s in subs)
        run = RequestRun(self.engine, self.metrics, subs, lambda: self._release(num_seqs), request_id, route)
        if self.in_flight + run.num_seqs > self.limits.max_in_flight:
            raise APIError(503, f"The server is overloaded: {self.in_flight} sequences in flight, this request "
                                f"adds {run.num_seqs}, the limit is {self.limits.max_in_flight}; retry later",
                           type_="server_error", code="overloaded", request_id=request_id)
        self.in_flight += run.num_seqs
        return run

    @staticmethod
    def _response_format(req: Any) -> StructuredOutputsParams | None:
        """The grammar ``response_format`` asks for (None for text); a 400 naming it when unusable."""
        fmt = req.response_format
        try:
            if isinstance(fmt, ResponseFormatJSONObject):
                spec = StructuredOutputsParams(json_object=True)
            elif isinstance(fmt, ResponseFormatJSONSchema):
                spec = StructuredOutputsParams(json=fmt.json_schema.schema_)
            else:
                return None
            check_grammar(spec)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", param="response_format") from e
        return spec

    def _params(self, req: Any, n: int, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None, structured: StructuredOutputsParams | None = None,
                skip_special_tokens: bool | None = None) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value
        logit_bias = req.logit_bias_ids()
        outside = sorted(t for t in logit_bias or {} if t >= self.vocab_size)
        if outside:
            raise APIError(400, f"logit_bias has token ids {outside[:5]} outside the vocabulary "
                                f"[0, {self.vocab_size})", param="logit_bias")
        try:
            return SamplingParams(
                n=n, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), top_k=pick(req.top_k, 0),
                min_p=pick(req.min_p, 0.0), seed=req.seed, max_tokens=max_tokens, min_tokens=pick(req.min_tokens, 0),
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=pick(req.ignore_eos, False),
                include_stop_str_in_output=pick(req.include_stop_str_in_output, False), logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=pick(skip_special_tokens, pick(req.skip_special_tokens, True)),
                presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
                repetition_penalty=pick(req.repetition_penalty, 1.0), logit_bias=logit_bias,
                structured_outputs=structured)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from e

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(self._counter)}"

    def _holdback(self, params: SamplingParams) -> int:
        return max((len(s) for s in params.stop or ()), default=1) - 1

    # ---- /v1/completions ------------------------------------------------------------------------------------
    def _completion_subs(self, req: CompletionRequest) -> tuple[list[SubRequest], bool]:
        self._check_model(req.model)
        n = req.n or 1
        self._check_n(n)
        prompts = req.prompts()
        score_only = req.max_tokens == 0
        seqs = len(prompts) * (1 if score_only else n)
        if seqs > self.limits.max_in_flight:   # can never be admitted, however long the client waits
            raise APIError(400, f"this request asks for {seqs} sequences ({len(prompts)} prompts x n), over the "
                                f"server's limit of {self.limits.max_in_flight} sequences in flight; split it",
                           param="prompt")
        echo = bool(req.echo)
        structured = self._response_format(req)
        base_id = self._new_id("cmpl")
        subs = []
        vocab = self.vocab_size
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if not prompt:
                    raise APIError(400, "prompt is empty", param="prompt")
                ids, text = self.tokenizer.encode(prompt), prompt
            else:
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise APIError(400, f"prompt contains token ids {bad[:5]} outside the vocabulary [0, {vocab})",
                                   param="prompt")
                ids, text = list(prompt), self.tokenizer.decode(prompt, skip_special_tokens=False)
            max_tokens = self._max_tokens(req.max_tokens, len(ids), DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens",
                                          "prompt")
            if score_only and not echo:
                raise APIError(400, "max_tokens=0 is only allowed with echo=true (it scores the prompt)",
                               param="max_tokens")
            params = self._params(req, 1 if score_only else n, max(max_tokens, 1), req.logprobs,
                                  req.logprobs if echo and req.logprobs is not None else None, structured)
            subs.append(SubRequest(f"{base_id}-{i}", text, ids, params, score_only))
        return subs, echo

    def _legacy_logprobs(self, ids: list[int], entries: Sequence[PositionLogprobs | None], offset: int
                         ) -> tuple[dict[str, list[Any]], int]:
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, entry in zip(ids, entries):
            top: dict[str, float] | None = None
            if entry is None or tid not in entry:
                token, lp = self.tokenizer.decode([tid]), None
            else:
                token = entry[tid].decoded_token or ""
                lp = entry[tid].logprob
                top = {}
                for _, v in _sorted_entries(entry):  # tokens that decode alike: keep the most likely one
                    top.setdefault(v.decoded_token or "", v.logprob)
            tokens.append(token)
            token_lps.append(lp)
            tops.append(top)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def _choice_parts(self, sub: SubRequest, c: CompletionOutput, echo: bool, first: bool, sent_text: int,
                      sent_tokens: int, offset: int, final_text: bool) -> tuple[str, dict | None, int, int, int]:
        """New text and logprobs of one choice since (sent_text, sent_tokens); returns them with the new marks."""
        text, ids, lps, reason = visible(sub, c)
        visible_text = text
        if reason is None and not final_text:  # hold back what may be the start of a stop string
            visible_text = text[:max(sent_text, len(text) - self._holdback(sub.params))]
        delta = visible_text[sent_text:]
        logprobs = None
        want_lps = sub.params.logprobs is not None
        if want_lps:
            merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if echo and first:
                p_entries = sub.latest.prompt_logprobs if sub.latest and sub.latest.prompt_logprobs else \
                    [None] * len(sub.prompt_ids)
                part, offset = self._legacy_logprobs(sub.prompt_ids, p_entries, offset)
                for k in merged:
                    merged[k] += part[k]
            part, offset = self._legacy_logprobs(ids[sent_tokens:], list(lps or [])[sent_tokens:], offset)
            for k in merged:
                merged[k] += part[k]
            logprobs = merged
        if echo and first:
            delta = sub.prompt_text + delta
        return delta, logprobs, len(visible_text), len(ids), offset

    async def completion(self, req: CompletionRequest, disconnect: Callable[[], Awaitable[None]]
                         ) -> dict[str, Any] | Stream:
        subs, echo = await asyncio.to_thread(self._completion_subs, req)
        rid = subs[0].request_id.rsplit("-", 1)[0]
        run = self._admit(subs, rid, "/v1/completions")
        await run.start()
        created, model, n = int(time.time()), self.limits.served_model_name, req.n or 1
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return Stream(self._completion_stream(run, echo, n, rid, created, model, include_usage), run.close)
        await _run_to_completion(run, disconnect)
        choices = []
        for i, sub in enumerate(subs):
            assert sub.latest is not None
            for c in sub.latest.outputs:
                text, lps, _, _, _ = self._choice_parts(sub, c, echo, True, 0, 0, 0, True)
                choices.append({"index": i * n + c.index, "text": text, "logprobs": lps,
                                "finish_reason": visible(sub, c)[3]})
            if sub.score_only and n > 1:  # the prompt was scored once; every requested choice gets the result
                choices += [dict(choices[-1], index=i * n + k) for k in range(1, n)]
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": usage(run)}

    async def _completion_stream(self, run: RequestRun, echo: bool, n: int, rid: str, created: int, model: str,
                                 include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks of a completion request: one choice per chunk, a choice's finish reason with its last text;
        with ``include_usage``, ``usage: null`` on each chunk and a last chunk of ``choices: []`` with the usage."""
        marks: dict[tuple[int, int], tuple[int, int, int, bool]] = {}  # (sub, choice) -> text, tokens, offset, done
        try:
            async for changed in run.updates():
                choices = []
                for sub in changed:
                    i = run.subs.index(sub)
                    assert sub.latest is not None
                    for c in sub.latest.outputs:
                        key = (i, c.index)
                        st, tk, off, done = marks.get(key, (0, 0, 0, False))
                        if done:
                            continue
                        first = key not in marks
                        text, lps, st, tk, off = self._choice_parts(sub, c, echo, first, st, tk, off, False)
                        reason = visible(sub, c)[3]
                        marks[key] = (st, tk, off, reason is not None)
                        if text or reason is not None or (lps and lps["tokens"]):
                            for k in range(n if sub.score_only else 1):
                                choices.append({"index": i * n + c.index + k, "text": text, "logprobs": lps,
                                                "finish_reason": reason})
                for choice in choices:   # one choice per chunk, as OpenAI and vLLM send them
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage(run)})
        except APIError as e:
            run.failed(e)
            yield sse(e.body())
        finally:
            run.close()
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions -------------------------------------------------------------------------------
    def _chat_sub(self, req: ChatCompletionRequest) -> SubRequest:
        return self._chat_prepare(req)[0]

    def _chat_prepare(self, req: ChatCompletionRequest) -> tuple[SubRequest, ToolPlan]:
        """The engine request of a chat request and its :class:`ToolPlan` (run in a worker thread)."""
        self._check_model(req.model)
        n = req.n or 1
        self._check_n(n)
        ids = self.tokenizer.chat_ids(req.messages, tools=req.tool_dicts())   # first: a template without tools
        plan = plan_tools(req, self.tool_options)                             # support is the first thing to fix
        max_tokens = self._max_tokens(req.token_limit, len(ids), None,
                                      "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                                      "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        structured = plan.structured if plan.structured is not None else self._response_format(req)
        # a tool-call parser reads the markers (<tool_call>), which some tokenizers mark special (as vLLM does)
        params = self._params(req, n, max_tokens, logprobs, None, structured,
                              skip_special_tokens=False if plan.mode == "auto" else None)
        return SubRequest(self._new_id("chatcmpl"), "", ids, params, False), plan

    def _chat_logprobs(self, sub: SubRequest, ids: list[int], lps: list[PositionLogprobs]) -> list[dict[str, Any]]:
        """OpenAI's chat logprobs; ``bytes`` are each token's real bytes (part of a UTF-8 character included), so
        that joining the chosen tokens' bytes rebuilds the text."""
        k = sub.params.logprobs or 0
        n = min(len(ids), len(lps))
        ids, lps = list(ids)[:n], list(lps)[:n]
        tops = [[(t, v) for t, v in _sorted_entries(entry) if v.rank is not None and v.rank <= k][:k]
                for entry in lps]
        all_ids = ids + [t for top in tops for t, _ in top]
        raw = iter(self.tokenizer.token_bytes(all_ids))
        chosen_bytes = [next(raw) for _ in ids]
        out = []
        for tid, entry, top, token_bytes in zip(ids, lps, tops, chosen_bytes):
            chosen = entry[tid]
            top_items = [{"token": v.decoded_token or "", "logprob": v.logprob, "bytes": list(next(raw))}
                         for _, v in top]
            out.append({"token": chosen.decoded_token or "", "logprob": chosen.logprob, "bytes": list(token_bytes),
                        "top_logprobs": top_items})
        return out

    async def chat(self, req: ChatCompletionRequest, disconnect: Callable[[], Awaitable[None]]
                   ) -> dict[str, Any] | Stream:
        sub, plan = await asyncio.to_thread(self._chat_prepare, req)
        run = self._admit([sub], sub.request_id, "/v1/chat/completions")
        await run.start()
        created, model = int(time.time()), self.limits.served_model_name
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return Stream(self._chat_stream(run, sub, plan, created, model, include_usage), run.close)
        await _run_to_completion(run, disconnect)
        assert sub.latest is not None
        choices = []
        for c in sub.latest.outputs:
            _, ids, content_lps, _ = visible(sub, c)
            lps = {"content": self._chat_logprobs(sub, ids, content_lps)} if content_lps is not None else None
            message, reason = plan.message(c.text, c.finish_reason)
            choices.append({"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason})
        return {"id": sub.request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage(run)}

    async def _chat_stream(self, run: RequestRun, sub: SubRequest, plan: ToolPlan, created: int, model: str,
                           include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks of a chat request. With a tool parser, each update's text is parsed again and the difference
        to what was sent goes out as ``content`` and ``tool_calls`` deltas (:class:`ToolCallStream`).

        Shape (OpenAI's, which clients that read ``choices[0]`` of each chunk rely on): every chunk holds exactly
        one choice; a choice's first chunk carries the role, its last one its finish reason (with the last delta,
        if any); with ``include_usage`` every chunk has ``usage: null`` and one more chunk after the choices holds
        ``choices: []`` and the usage."""
        base = {"id": sub.request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        if include_usage:
            base["usage"] = None
        marks: dict[int, tuple[int, int, bool]] = {}
        tool_streams = {i: ToolCallStream() for i in range(sub.params.n)}
        # the role chunk's content: null whenever the answer may be tool calls (OpenAI's), "" for plain text; the
        # content deltas that follow then add up to the non-streamed content (None for an answer of calls only)
        first_content = None if plan.parser is not None else ""
        try:
            for i in range(sub.params.n):
                yield sse(dict(base, choices=[{"index": i, "delta": {"role": "assistant", "content": first_content},
                                               "logprobs": None, "finish_reason": None}]))
            async for _ in run.updates():
                assert sub.latest is not None
                choices = []
                for c in sub.latest.outputs:
                    st, tk, done = marks.get(c.index, (0, 0, False))
                    if done:
                        continue
                    text = c.text if c.finish_reason else c.text[:max(st, len(c.text) - self._holdback(sub.params))]
                    _, ids, content_lps, _ = visible(sub, c)
                    new_ids = ids[tk:]
                    lps = None
                    if content_lps is not None and new_ids:
                        lps = {"content": self._chat_logprobs(sub, new_ids, content_lps[tk:])}
                    marks[c.index] = (len(text), len(ids), c.finish_reason is not None)
                    reason = c.finish_reason
                    delta: dict[str, Any] = {}
                    if plan.parser is None:
                        if text[st:] or lps:
                            delta["content"] = text[st:]
                    else:
                        parsed = plan.parser.parse(text, final=reason is not None)
                        content, calls = tool_streams[c.index].step(parsed)
                        if content:
                            delta["content"] = content
                        if calls:
                            delta["tool_calls"] = calls
                        reason = plan.finish_reason(parsed, reason)
                    if delta or lps or reason is not None:   # the last text and the finish reason together
                        choices.append({"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": reason})
                for choice in choices:   # one choice per chunk, as OpenAI and vLLM send them
                    yield sse(dict(base, choices=[choice]))
            if include_usage:
                yield sse(dict(base, choices=[], usage=usage(run)))
        except APIError as e:
            run.failed(e)
            yield sse(e.body())
        finally:
            run.close()
        yield "data: [DONE]\n\n"

    # ---- /v1/responses (stateless; :mod:`kv8.entrypoints.openai.responses`) -------------------------------------
    def _responses_prepare(self, req: ResponsesRequest) -> tuple[SubRequest, ToolPlan]:
        """The engine request of a Responses request, through its chat equivalent (run in a worker thread); the
        chat machinery's 400s name the Responses fields."""
        self._check_model(req.model)
        try:
            chat = req.chat_request()
            ids = self.tokenizer.chat_ids(chat.messages, tools=chat.tool_dicts())
            plan = plan_tools(chat, self.tool_options)
            max_tokens = self._max_tokens(req.max_output_tokens, len(ids), None, "max_output_tokens", "input")
            structured = plan.structured if plan.structured is not None else self._response_format(chat)
            params = self._params(chat, 1, max_tokens, None, None, structured,
                                  skip_special_tokens=False if plan.mode == "auto" else None)
        except APIError as e:
            raise renamed(e) from e
        return SubRequest(f"resp_{uuid.uuid4().hex}", "", ids, params, False), plan

    @staticmethod
    def _responses_usage(run: RequestRun, sub: SubRequest) -> dict[str, Any]:
        counts = usage(run)
        cached = sub.latest.num_cached_tokens if sub.latest is not None else 0
        return responses_usage(counts["prompt_tokens"], counts["completion_tokens"], cached)

    async def responses(self, req: ResponsesRequest, disconnect: Callable[[], Awaitable[None]]
                        ) -> dict[str, Any] | Stream:
        sub, plan = await asyncio.to_thread(self._responses_prepare, req)
        run = self._admit([sub], sub.request_id, "/v1/responses")
        await run.start()
        response = response_object(req, sub.request_id, int(time.time()), self.limits.served_model_name)
        if req.stream:
            return Stream(self._responses_stream(run, sub, plan, response), run.close)
        await _run_to_completion(run, disconnect)
        assert sub.latest is not None
        c = sub.latest.outputs[0]
        message, reason = plan.message(c.text, c.finish_reason)
        response["output"] = output_items(message, reason == "length")
        return finish(response, reason == "length", self._responses_usage(run, sub))

    async def _responses_stream(self, run: RequestRun, sub: SubRequest, plan: ToolPlan, response: dict[str, Any]
                                ) -> AsyncIterator[str]:
        """The Responses events of a streamed request (:class:`ResponseEvents`): text as it is generated (a stop
        string's possible beginning held back, as on chat), calls as the tool parser reads them."""
        events = ResponseEvents(response, defer_calls=plan.mode == "auto")
        calls = ToolCallStream()
        sent = 0
        reason = None
        try:
            for event in events.start():
                yield event
            async for _ in run.updates():
                assert sub.latest is not None
                c = sub.latest.outputs[0]
                reason = c.finish_reason
                text = c.text if reason else c.text[:max(sent, len(c.text) - self._holdback(sub.params))]
                deltas: list[dict[str, Any]] = []
                if plan.parser is None:
                    new_text = text[sent:]
                    sent = len(text)
                else:
                    new_text, deltas = calls.step(plan.parser.parse(text, final=reason is not None))
                for event in events.step(new_text, deltas):
                    yield event
            for event in events.finish(reason == "length", self._responses_usage(run, sub)):
                yield event
        except APIError as e:
            run.failed(e)
            for event in events.fail(e):
                yield event
        finally:
            run.close()
