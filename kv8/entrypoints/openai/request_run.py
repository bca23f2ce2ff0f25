"""One HTTP request's engine requests: admission, outputs, disconnects and the capacity they hold.

A :class:`RequestRun` holds one :class:`SubRequest` per prompt. ``start`` adds them to the engine (a
``ValueError`` from the engine becomes a 400, a stopped engine a 503); ``updates`` yields the sub-requests
whose outputs changed, coalescing everything that arrived since the last call, until all are finished;
``close`` aborts whatever is unfinished (freeing its KV blocks before the engine's next step), counts the
aborted sequences, and gives the run's capacity back. ``close`` is idempotent and must run however the
HTTP request ends: normally, on an error, or when the client goes away.

A request that ends in a 5xx (a failed generation: ``finish_reason="error"`` as a 500 ``generation_failed``; an
engine that went away; overload) leaves one log line naming its id, route and reason (:func:`log_failure`): the
route's wrapper logs the errors a non-streamed request raises, a stream logs the error event it ends with.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kv8.engine.async_engine import AsyncEngine, EngineDeadError, OutputMailbox
from kv8.entrypoints.openai.metrics import ServerMetrics
from kv8.entrypoints.openai.protocol import APIError
from kv8.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kv8.sampling_params import SamplingParams

logger = logging.getLogger("kv8.server")


def log_failure(route: str, error: APIError, request_id: str | None = None) -> None:
    """The one log line of a request that ends with ``error`` when it is a 5xx (ERROR for a 500, WARNING for the
    503s of an overloaded, draining or stopped server); nothing for a 4xx, which is the client's. ``request_id``:
    the request's id (the answer's ``id`` and the error's ``X-Request-Id``), else the error's, else ``-`` (refused
    before it got one)."""
    if error.status < 500:
        return
    rid = request_id or error.request_id or "-"
    logger.log(logging.ERROR if error.status == 500 else logging.WARNING, "request %s (%s) failed: %d %s: %s",
               rid, route, error.status, error.code or error.type, error.message)


class ClientDisconnected(Exception):
    """The client went away: during the body ``upload`` (nothing was started), or ``waiting`` for a non-streamed
    answer (its engine requests were aborted)."""

    def __init__(self, stage: str = "waiting", detail: str = "") -> None:
        super().__init__(f"client disconnected ({stage}{': ' + detail if detail else ''})")
        self.stage = stage
        self.detail = detail


@dataclass(frozen=True)
class Stream:
    """An SSE body and the function that aborts its requests; ``close`` must run even if ``chunks`` never
    starts (a client that disconnects before the first chunk), and is idempotent."""

    chunks: AsyncIterator[str]
    close: Callable[[], None]


@dataclass
class SubRequest:
    """One engine request: one prompt of the HTTP request."""

    request_id: str
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    score_only: bool             # max_tokens=0: prompt logprobs only, the sampled token is dropped
    latest: RequestOutput | None = None
    first_token: dict[int, float] = field(default_factory=dict)   # choice index -> time of its first token
    num_tokens: dict[int, int] = field(default_factory=dict)      # choice index -> tokens counted so far
    recorded: set[int] = field(default_factory=set)               # choice indexes whose finish was counted


class RequestRun:
    """The engine requests of one HTTP request, and the mailbox their outputs arrive in.

    ``release`` is called exactly once, by :meth:`close`, when the run stops holding server capacity.
    """

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, subs: list[SubRequest],
                 release: Callable[[], None], request_id: str, route: str) -> None:
        self.engine = engine
        self.request_id = request_id   # the HTTP request's id (its answer's ``id``); its errors carry it
        self.route = route             # its route's path, for the log
        self.metrics = metrics
        self.release = release
        self.subs = subs
        self.by_id = {s.request_id: s for s in subs}
        self.mailbox = OutputMailbox()
        self.arrival = time.monotonic()
        self.num_seqs = sum(s.params.n for s in subs)
        self.added: list[SubRequest] = []
        self.closed = False

    async def start(self) -> None:
        engine = self.engine
        try:
            for sub in self.subs:
                await engine.add(sub.request_id, sub.prompt_ids, sub.params, self.mailbox)
                self.added.append(sub)
                self.metrics.prompt_tokens += len(sub.prompt_ids)
        except ValueError as e:
            self.close()
            raise APIError(400, str(e), param="prompt", request_id=self.request_id) from e
        except EngineDeadError as e:
            self.close()
            raise APIError(503, str(e), type_="server_error", code="engine_unavailable",
                           request_id=self.request_id) from e
        except BaseException:
            self.close()
            raise

    def failed(self, error: APIError) -> None:
        """Log ``error``, which ends the run's stream (:func:`log_failure`)."""
        log_failure(self.route, error, self.request_id)

    def finished(self) -> bool:
        return all(s.latest is not None and s.latest.finished for s in self.subs)

    async def updates(self, disconnect: asyncio.Future[Any] | None = None) -> AsyncIterator[list[SubRequest]]:
        """Yield the subs that changed, until all finished. Raises ClientDisconnected if ``disconnect`` fires."""
        while not self.finished():
            get = asyncio.ensure_future(self.mailbox.get_all())
            try:
                if disconnect is not None:
                    waiting: set[asyncio.Future[Any]] = {get, disconnect}
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        raise ClientDisconnected()
                items = await get
            finally:
                if not get.done():
                    get.cancel()
            changed: dict[str, SubRequest] = {}
            for rid, out in items:
                if isinstance(out, BaseException):
                    raise APIError(503, str(out), type_="server_error", code="engine_unavailable",
                                   request_id=self.request_id)
                sub = self.by_id[rid]
                sub.latest = out
                changed[rid] = sub
                self._observe(sub, out)
                failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
                if failed is not None:   # this request alone failed; the engine goes on serving the others
                    raise APIError(500, f"generation failed: {failed.error}", type_="server_error",
                                   code="generation_failed", request_id=self.request_id)
            yield list(changed.values())

    def _observe(self, sub: SubRequest, out: RequestOutput) -> None:
        now = time.monotonic()
        metrics = self.metrics
        for c in out.outputs:
            ntok = len(c.token_ids)
            metrics.generation_tokens += ntok - sub.num_tokens.get(c.index, 0)
            sub.num_tokens[c.index] = ntok
            if ntok and c.index not in sub.first_token:
                sub.first_token[c.index] = now
                metrics.ttft.observe(now - self.arrival)
            if c.finish_reason is not None and c.index not in sub.recorded:
                sub.recorded.add(c.index)
                if ntok > 1:
                    metrics.tpot.observe((now - sub.first_token[c.index]) / (ntok - 1))
                metrics.record_finished(c.finish_reason)

    def close(self) -> None:
        """Abort whatever is unfinished and give back the in-flight slots (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for sub in self.added:
            if sub.latest is None or not sub.latest.finished:
                self.engine.abort(sub.request_id)
                for _ in range(sub.params.n - len(sub.recorded)):
                    self.metrics.record_finished("abort")
        self.release()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(run: RequestRun) -> dict[str, int]:
    prompt = sum(len(s.prompt_ids) for s in run.subs)
    # every generated token counts, a stop token that added no text included (as vLLM counts them)
    completion = sum(0 if s.score_only else len(c.token_ids) for s in run.subs if s.latest for c in s.latest.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def visible(sub: SubRequest, c: CompletionOutput) -> tuple[str, list[int], list[PositionLogprobs] | None, str | None]:
    """text, token ids, logprobs and finish reason the client sees (nothing generated for max_tokens=0).

    The ids (and their logprobs) are those whose text the answer holds: a token that stopped the request (EOS or
    one of ``stop_token_ids``) added no text (:mod:`kv8.engine.output_processor`), so it has no logprobs entry
    either, and the ``bytes`` of the chat logprobs join to the answer's UTF-8 (OpenAI's shape: no end token)."""
    if sub.score_only:
        return "", [], [] if c.logprobs is not None else None, ("length" if c.finish_reason else None)
    n = len(c.token_ids)
    if c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and not sub.params.include_stop_str_in_output:
        n -= 1
    return c.text, c.token_ids[:n], None if c.logprobs is None else c.logprobs[:n], c.finish_reason
