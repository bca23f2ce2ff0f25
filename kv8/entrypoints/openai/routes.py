"""The OpenAI routes an engine answers, declared once.

``kv8 serve``'s app registers each route of :func:`enabled_routes` (:func:`kv8.entrypoints.openai.api_server.
build_app`); the data-parallel ingress registers the same ones as forwarders (:mod:`kv8.entrypoints.dp.ingress`),
and a replica answers a forwarded request by the route's name (:mod:`kv8.entrypoints.dp.replica`). A route is its
name, HTTP method and path, the pydantic model of its JSON body (None: it takes no body) and how
:class:`OpenAIServing` answers it. ``/v1/models``, ``/health`` and ``/metrics`` are not here: each endpoint
answers them from its own state (one engine, or the replicas it routes to).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

from kv8.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)
from kv8.entrypoints.openai.request_run import Stream
from kv8.entrypoints.openai.responses import ResponsesRequest

if TYPE_CHECKING:
    from kv8.entrypoints.openai.cli_args import ServerArgs
    from kv8.entrypoints.openai.serving import OpenAIServing

#: waits until the client went away (returns then); a request's generation is aborted when it returns
Disconnected = Callable[[], Awaitable[None]]
Answer = Callable[["OpenAIServing", Any, Disconnected], Awaitable["dict[str, Any] | Stream"]]


@dataclass(frozen=True)
class Route:
    """One route. Invariant: ``request`` is None exactly for the routes without a body (the GETs)."""

    name: str
    method: Literal["GET", "POST"]
    path: str
    request: type[BaseModel] | None
    answer: Answer
    enabled_by: str | None = None    # the ServerArgs field that turns the route on; None: always served

    def enabled(self, args: ServerArgs) -> bool:
        return self.enabled_by is None or bool(getattr(args, self.enabled_by))

    def parse(self, body: dict[str, Any]) -> Any:
        """The request ``body`` validated strictly by the route's model (a 400 naming the field otherwise); None
        for a route without a body."""
        if self.request is None:
            return None
        try:
            return self.request.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from e


async def _completion(serving: OpenAIServing, req: Any, disconnected: Disconnected) -> dict[str, Any] | Stream:
    return await serving.completion(req, disconnected)


async def _chat(serving: OpenAIServing, req: Any, disconnected: Disconnected) -> dict[str, Any] | Stream:
    return await serving.chat(req, disconnected)


async def _responses(serving: OpenAIServing, req: Any, disconnected: Disconnected) -> dict[str, Any] | Stream:
    return await serving.responses(req, disconnected)


# the tokenizer routes run off the event loop: a long text takes a while to (de)tokenize
async def _tokenize(serving: OpenAIServing, req: Any, _: Disconnected) -> dict[str, Any]:
    return await asyncio.to_thread(serving.tokenize, req)


async def _detokenize(serving: OpenAIServing, req: Any, _: Disconnected) -> dict[str, Any]:
    return await asyncio.to_thread(serving.detokenize, req)


async def _tokenizer_info(serving: OpenAIServing, _: Any, __: Disconnected) -> dict[str, Any]:
    return await asyncio.to_thread(serving.tokenizer_info)


ROUTES: tuple[Route, ...] = (
    Route("completions", "POST", "/v1/completions", CompletionRequest, _completion),
    Route("chat", "POST", "/v1/chat/completions", ChatCompletionRequest, _chat),
    Route("responses", "POST", "/v1/responses", ResponsesRequest, _responses),
    Route("tokenize", "POST", "/tokenize", TokenizeRequest, _tokenize),
    Route("detokenize", "POST", "/detokenize", DetokenizeRequest, _detokenize),
    Route("tokenizer_info", "GET", "/tokenizer_info", None, _tokenizer_info,
          enabled_by="enable_tokenizer_info_endpoint"),
)
ROUTE_BY_NAME = {r.name: r for r in ROUTES}


def enabled_routes(args: ServerArgs) -> tuple[Route, ...]:
    """The routes a server with options ``args`` serves."""
    return tuple(r for r in ROUTES if r.enabled(args))


def route_named(name: str, args: ServerArgs) -> Route:
    """The enabled route ``name`` (a replica's dispatch); ``APIError`` 404 for another name."""
    route = ROUTE_BY_NAME.get(name)
    if route is None or not route.enabled(args):
        raise APIError(404, f"no route {name!r}")
    return route
