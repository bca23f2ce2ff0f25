"""One data-parallel replica: an engine with its own KV cache and the OpenAI endpoint logic, as a Ray Serve
deployment (:mod:`kv8.entrypoints.dp.app` runs N of them behind one ingress), and the values that travel
between the ingress and the replicas.

Protocol (:meth:`KV8Replica.handle`, called through a Serve streaming handle): ``handle(route, body)`` takes a
route's name (one of :data:`kv8.entrypoints.openai.routes.ROUTES`) and the request's JSON object, and yields
either one :class:`JSONReply` (an answer, or an OpenAI error with its status), or :data:`SSE_START` followed by
the SSE chunks (``str``). The request is validated and served by the same route and :class:`OpenAIServing` as
``kv8 serve``. Cancelling the call
(Serve cancels it when the ingress's client goes away) closes the stream, or the wait of a non-streamed
request, which aborts the engine requests: their KV blocks are freed before the next engine step.

A replica pins its torch threads to ``ReplicaSpec.threads`` before it builds the engine. Its engine thread
starts on the first call, inside the replica's event loop (every async call runs on that loop). Ray is not
imported here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kv8.engine.args import EngineArgs
from kv8.entrypoints.openai.cli_args import ServerArgs
from kv8.entrypoints.openai.protocol import APIError
from kv8.entrypoints.openai.request_run import log_failure
from kv8.entrypoints.openai.routes import ROUTE_BY_NAME, route_named

logger = logging.getLogger("kv8.ray_serve")


# ---- what travels between the ingress and the replicas --------------------------------------------------------
@dataclass(frozen=True)
class JSONReply:
    """A whole answer: ``status`` and JSON ``body`` (an OpenAI error body when status >= 400)."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SSEStart:
    """The answer is a stream: the SSE chunks (``str``) follow."""


SSE_START = SSEStart()


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica tells the ingress about itself (``/health``, ``/v1/models``)."""

    index: int
    pid: int
    node: str
    threads: int
    served_model_name: str
    max_model_len: int


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica is built from (picklable). Invariant: ``threads`` >= 1."""

    index: int
    engine_args: EngineArgs
    server: ServerArgs
    threads: int


# ---- the replica ----------------------------------------------------------------------------------------------
class KV8Replica:
    """One engine with its own KV cache and the OpenAI endpoint logic (a Serve deployment of one replica).

    The engine thread starts on the first call, inside the replica's event loop (every call runs on it)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        from kv8.engine.async_engine import AsyncEngine
        from kv8.engine.engine import LLMEngine
        from kv8.entrypoints.openai.api_server import serving_limits
        from kv8.entrypoints.openai.metrics import ServerMetrics
        from kv8.entrypoints.openai.serving import OpenAIServing

        torch.set_num_threads(spec.threads)
        self.spec = spec
        llm = LLMEngine(spec.engine_args)
        self.limits = serving_limits(llm, spec.server, spec.engine_args.model)
        self.engine = AsyncEngine(llm)
        self.metrics = ServerMetrics()
        self.serving = OpenAIServing(self.engine, self.limits, self.metrics, tool_options=spec.server.tool_options)
        self._node = _node_address()
        self._started = False

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self.engine.start()

    def check_health(self) -> None:
        """Serve's health check: fails once the engine failed, so that Serve replaces this replica."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine failed: {type(self.engine.error).__name__}: {self.engine.error}")

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.spec.index, os.getpid(), self._node, self.spec.threads,
                           self.limits.served_model_name, self.limits.max_model_len)

    async def metrics_text(self) -> str:
        self._start()
        return self.metrics.render(self.engine.stats(), self.serving.in_flight)

    async def handle(self, route: str, body: dict[str, Any]) -> AsyncIterator[JSONReply | SSEStart | str]:
        """Answer one request of ``route`` (a route's name) with its parsed JSON ``body``: one
        :class:`JSONReply`, or :data:`SSE_START` and the SSE chunks. Cancellation aborts the engine requests."""
        self._start()
        path = ROUTE_BY_NAME[route].path if route in ROUTE_BY_NAME else route
        try:
            result = await self._dispatch(route, body)
        except APIError as e:
            log_failure(path, e)
            self.metrics.record_rejected(e.status)
            yield JSONReply(e.status, e.body(), e.response_headers())
            return
        except Exception as e:  # noqa: BLE001 - answered as a 500, as kv8 serve does
            logger.exception("request - (%s) failed: 500 internal error", path)
            self.metrics.record_rejected(500)
            yield JSONReply(500, APIError(500, f"internal server error: {type(e).__name__}: {e}",
                                          type_="server_error").body())
            return
        if isinstance(result, dict):
            yield JSONReply(200, result)
            return
        try:
            yield SSE_START
            async for chunk in result.chunks:
                yield chunk
        finally:
            result.close()

    async def _dispatch(self, name: str, body: dict[str, Any]) -> Any:
        route = route_named(name, self.spec.server)
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running", type_="server_error", code="engine_unavailable")
        req = route.parse(body)

        async def never() -> None:   # a replica call ends by cancellation when its client goes away
            await asyncio.Event().wait()

        return await route.answer(self.serving, req, never)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)


def _node_address() -> str:
    return socket.gethostname()
