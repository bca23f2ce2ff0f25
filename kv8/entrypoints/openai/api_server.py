"""``kv8 serve`` / ``kv8 run``: an OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (all behind the API key
when one is set), ``GET /health`` and ``GET /metrics`` (Prometheus text, open).

Request bodies are read by hand rather than by FastAPI, so that every failure has OpenAI's error shape and a
precise status: 408 for headers or a body that do not arrive within ``--request-header-timeout`` /
``--request-body-timeout`` seconds (:mod:`kv8.entrypoints.openai.http_protocol`), 413 for a body over
``--max-request-bytes``, 400 for invalid UTF-8, malformed JSON (NaN and
Infinity included), a non-object body, wrong types, out-of-range values or unknown fields; 401 for a missing
or wrong API key, 404 for an unknown model or route, 503 when overloaded, draining or the engine is down.

Security defaults: binds 127.0.0.1 unless ``--host`` says otherwise; the API key (``--api-key`` or
``$KV8_API_KEY``) is compared in constant time; bodies, ``n`` and ``max_tokens`` are bounded; JSON only.

Shutdown (:class:`_Drain`): on SIGTERM/SIGINT the server drains: it keeps accepting connections, and new requests
get 503 ``shutting_down`` with ``Retry-After`` (``/health`` too), while in-flight requests run to completion for
up to ``--shutdown-timeout`` seconds and are then aborted (a stream ends with an error event and ``data: [DONE]``,
a non-streaming request gets a JSON 503). A second signal aborts them at once, the same way. Once no request is in
flight, uvicorn stops accepting and shuts down, the engine thread stops and the process exits 0 (uvicorn
re-raises the signal after shutting down; kv8's handlers absorb it). A third signal forces uvicorn out.

Engine failure: a failure that leaves the engine unusable (an exception escaping an engine step; one request's
failure does not) fails every open request with a 503, makes ``/health`` answer 503 with the error, prints one
``kv8: error:`` line and exits the process with status 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kv8 import envs
from kv8.engine.args import EngineArgs
from kv8.engine.async_engine import AsyncEngine
from kv8.entrypoints.openai.metrics import ServerMetrics
from kv8.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    lone_surrogate_path,
    validation_error,
)
from kv8.entrypoints.openai.request_run import ClientDisconnected, Stream
from kv8.entrypoints.openai.serving import OpenAIServing, ServingLimits
from kv8.entrypoints.openai.tool_calling import ToolOptions

if TYPE_CHECKING:
    from kv8.engine.engine import LLMEngine

logger = logging.getLogger("kv8.server")

API_KEY_ENV = envs.API_KEY_ENV
RETRY_AFTER_SHUTDOWN_S = 5   # the Retry-After of a 503 answered while the server drains


class SSEResponse(StreamingResponse):
    """A streaming response whose ``on_close`` runs however the response ends (finished, client gone,
    cancelled before the first chunk)."""

    def __init__(self, stream: Stream) -> None:
        super().__init__(stream.chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = stream.close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The raw body, at most ``limit`` bytes (413 beyond), all of it within ``timeout`` seconds (408 otherwise: a
    Content-Length larger than what arrives must not hold the connection forever). A client that goes away
    meanwhile raises :class:`ClientDisconnected` ("upload")."""
    body = bytearray()
    chunks = request.stream().__aiter__()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return bytes(body)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s (--request-body-timeout): "
                                f"{len(body)} bytes received" + (f" of the {request.headers['content-length']} "
                                "announced by Content-Length" if "content-length" in request.headers else ""),
                           code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ClientDisconnected("upload", f"{len(body)} bytes of the body received") from None
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body has more than {limit} bytes, over the limit of {limit} bytes")


async def read_json_body(request: Request, limit: int, timeout: float = 60.0) -> dict[str, Any]:
    # Only JSON bodies: a browser page can POST text/plain or a form to a server on 127.0.0.1 without a CORS
    # preflight, but not application/json.
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type {ctype or '(none)'!r} is not supported; send the request body as "
                            "application/json")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {int(length)} bytes, over the limit of {limit} bytes")
    body = await _read_body(request, limit, timeout)
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})") from e
    try:
        obj = json.loads(text, parse_constant=_json_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    bad = lone_surrogate_path(obj)
    if bad is not None:
        raise APIError(400, f"the request holds a lone UTF-16 surrogate escape (in {bad}), which is not a "
                            "character; send text as valid Unicode", param=bad or None)
    return obj


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def check_api_key(request: Request, api_key: str | None) -> None:
    """``APIError`` 401 unless the request carries ``Authorization: Bearer <api_key>`` (nothing to check without a
    key); compared in constant time."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect or missing API key; send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def models_response(served_model_name: str, max_model_len: int) -> JSONResponse:
    """``GET /v1/models``: the one model an endpoint serves, in OpenAI's list shape."""
    return JSONResponse({"object": "list", "data": [{
        "id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "kv8",
        "max_model_len": max_model_len}]})


def install_error_handlers(app: FastAPI, on_rejected: Callable[[int], None],
                           on_disconnect: Callable[[Request, ClientDisconnected], None]) -> Callable[[APIError],
                                                                                                     JSONResponse]:
    """OpenAI-shaped errors for ``app``: an :class:`APIError` and starlette's own (404/405 naming the route) answer
    with their status (``on_rejected(status)`` counts them; a 401 carries ``WWW-Authenticate``); a client that went
    away gets 499 after ``on_disconnect``. Returns the function that turns an ``APIError`` into that response."""
    def error_response(e: APIError) -> JSONResponse:
        on_rejected(e.status)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        return JSONResponse(e.body(), status_code=e.status, headers={**headers, **e.headers})

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(APIError(e.status_code, msg))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected) -> Response:
        on_disconnect(request, e)
        return Response(status_code=499)

    return error_response


def build_app(engine: AsyncEngine, limits: ServingLimits, api_key: str | None, max_request_bytes: int,
              allowed_origins: tuple[str, ...] = (), body_timeout: float = 60.0,
              tool_options: ToolOptions | None = None) -> FastAPI:
    """The ASGI app. ``app.state.draining`` set to True makes new /v1 requests answer 503; ``app.state.metrics``
    is its :class:`ServerMetrics`."""
    metrics = ServerMetrics()
    serving = OpenAIServing(engine, limits, metrics, tool_options=tool_options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="kv8", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    app.state.serving = serving
    app.state.metrics = metrics
    if allowed_origins:  # CORS is off unless origins are named: no browser page may read kv8's answers
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    def gone(request: Request, e: ClientDisconnected) -> None:
        metrics.record_disconnect(e.stage)
        if e.stage == "upload":   # nothing was generated yet: worth one line, not a traceback
            logger.warning("client went away during the request body upload (%s %s, %s)", request.method,
                           request.url.path, e.detail)

    error_response = install_error_handlers(app, metrics.record_rejected, gone)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(APIError(500, f"internal server error: {type(e).__name__}: {e}", type_="server_error"))

    def check_access(request: Request) -> None:
        check_api_key(request, api_key)
        if app.state.draining:
            raise APIError(503, "the server is shutting down; retry on another instance or once it restarted",
                           type_="server_error", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_SHUTDOWN_S)})
        if not engine.is_running:
            raise APIError(503, "the engine is not running", type_="server_error", code="engine_unavailable")

    def respond(result: dict[str, Any] | Stream) -> Response:
        if isinstance(result, Stream):
            return SSEResponse(result)
        return JSONResponse(result)

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"status": f"engine failed: {type(engine.error).__name__}: {engine.error}"},
                                status_code=503)
        if not engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        if app.state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_SHUTDOWN_S)})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(engine.stats(), serving.in_flight),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_access(request)
        return models_response(limits.served_model_name, limits.max_model_len)

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        """Check the key, read the bounded JSON body and validate it strictly (errors become 4xx)."""
        check_access(request)
        body = await read_json_body(request, max_request_bytes, body_timeout)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from e

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        return respond(await serving.completion(req, lambda: _wait_disconnect(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        return respond(await serving.chat(req, lambda: _wait_disconnect(request)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse(request, TokenizeRequest)
        return JSONResponse(await asyncio.to_thread(serving.tokenize, req))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse(request, DetokenizeRequest)
        return JSONResponse(await asyncio.to_thread(serving.detokenize, req))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        check_access(request)
        return JSONResponse(await asyncio.to_thread(serving.tokenizer_info))

    return app


class _Drain:
    """The graceful shutdown, on the event loop: wait until no request is in flight, at most ``timeout`` seconds
    (or until :meth:`abort_now`), abort what is left (each request then ends with its error: an error event in a
    stream, a JSON 503 otherwise) and wait for those answers to be written, then tell uvicorn to exit.

    Invariant: ``server.should_exit`` is set only once no request holds capacity, or after a bounded wait, so
    uvicorn never cancels a request mid-write (which answered a plain-text 500 and logged a CancelledError)."""

    WRITE_ERRORS_S = 5.0   # how long aborted requests get to write their error answers

    def __init__(self, serving: OpenAIServing, engine: AsyncEngine, server: Any, timeout: float) -> None:
        self.serving = serving
        self.engine = engine
        self.server = server
        self.timeout = timeout
        self._abort: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._abort = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def abort_now(self) -> None:
        if self._abort is not None:
            self._abort.set()

    async def _idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight (True) or ``timeout`` passed or an abort was asked for (False)."""
        assert self._abort is not None
        deadline = asyncio.get_running_loop().time() + timeout
        while self.serving.in_flight > 0:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or self._abort.is_set():
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._abort.wait(), min(left, 0.05))
        return True

    async def _run(self) -> None:
        if not await self._idle(self.timeout):
            why = ("a second interrupt" if self._abort is not None and self._abort.is_set()
                   else f"the {self.timeout:g} s shutdown timeout")
            logger.warning("shutting down: aborting the %d sequences in flight (%s)", self.serving.in_flight, why)
            self.engine.abort_all(f"the server is shutting down; the request was aborted after {why}")
            self._abort = asyncio.Event()        # a further signal must not cut the error answers short
            await self._idle(self.WRITE_ERRORS_S)
        self.server.should_exit = True


# ---- command line (flags are defined in kv8.entrypoints.cli.add_server_args) -----------------------------------
def _positive(name: str, value: int | float | None) -> None:
    if value is not None and (isinstance(value, bool) or value <= 0):
        raise ValueError(f"--{name.replace('_', '-')}={value!r} must be > 0")


def check_server_args(ns: argparse.Namespace) -> str | None:
    """Validate the server flags (``ValueError`` naming the flag); returns the API key (flag, else
    ``$KV8_API_KEY``, else None)."""
    for name in ("max_n", "max_tokens_limit", "max_request_bytes", "shutdown_timeout", "request_header_timeout",
                 "request_body_timeout"):
        _positive(name, getattr(ns, name))
    if ns.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests={ns.max_waiting_requests} must be >= 0")
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port={ns.port} must be in [0, 65535]")
    api_key = ns.api_key if ns.api_key is not None else envs.api_key()
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key must not be empty")
    return api_key


@dataclass(frozen=True)
class ServerOptions:
    """The server flags that shape an engine's endpoint: its :class:`ServingLimits` and tool options (a picklable
    value: data-parallel replicas receive it)."""

    served_model_name: str
    max_tokens_limit: int | None
    max_n: int
    max_waiting_requests: int
    tool_options: ToolOptions

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, model: str) -> ServerOptions:
        """``ValueError`` for tool flags that do not go together (:class:`ToolOptions`)."""
        return cls(ns.served_model_name or model, ns.max_tokens_limit, ns.max_n, ns.max_waiting_requests,
                   ToolOptions(ns.enable_auto_tool_choice, ns.tool_call_parser))


def serving_limits(llm: LLMEngine, opts: ServerOptions) -> ServingLimits:
    """The per-request limits of a server on ``llm`` (``ValueError`` if ``--max-tokens-limit`` exceeds the
    context)."""
    cfg = llm.config
    max_model_len = cfg.scheduler.max_model_len
    if opts.max_tokens_limit is not None and opts.max_tokens_limit > max_model_len:
        raise ValueError(f"--max-tokens-limit={opts.max_tokens_limit} exceeds max_model_len={max_model_len}")
    return ServingLimits(
        served_model_name=opts.served_model_name, max_model_len=max_model_len,
        max_tokens=opts.max_tokens_limit or max_model_len, max_n=opts.max_n,
        max_in_flight=cfg.scheduler.max_num_seqs + opts.max_waiting_requests,
        kv_capacity_tokens=llm.stats()["num_blocks"] * cfg.cache.block_size, kv_block_size=cfg.cache.block_size)


def run_server(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    import uvicorn

    from kv8.engine.engine import LLMEngine
    from kv8.entrypoints.openai.http_protocol import header_timeout_protocol

    api_key = check_server_args(ns)
    opts = ServerOptions.from_namespace(ns, engine_args.model)

    llm = LLMEngine(engine_args)
    cfg = llm.config
    limits = serving_limits(llm, opts)

    failures: list[BaseException] = []

    def engine_failed(error: BaseException) -> None:
        """The engine cannot serve any more: say so once and stop the server; run_server then returns 1."""
        failures.append(error)
        print(f"kv8: error: the engine failed and cannot serve any more requests ({type(error).__name__}: "
              f"{error}); exiting with status 1 so that a supervisor can restart kv8", file=sys.stderr, flush=True)
        server.should_exit = True

    async_engine = AsyncEngine(llm, on_failure=engine_failed)
    app = build_app(async_engine, limits, api_key, ns.max_request_bytes, tuple(ns.allowed_origins),
                    ns.request_body_timeout, opts.tool_options)

    class Server(uvicorn.Server):
        """uvicorn, whose exit signals start a drain (see the module docstring) instead of closing the listener."""

        signals = 0

        def handle_exit(self, sig: int, frame: Any) -> None:
            loop = getattr(app.state, "loop", None)
            self.signals += 1
            if loop is None or self.signals > 2:   # not started yet, or a third signal: uvicorn's own exit
                super().handle_exit(sig, frame)
                if self.signals > 2:
                    self.force_exit = True
                return
            app.state.draining = True
            loop.call_soon_threadsafe(drain.start if self.signals == 1 else drain.abort_now)

    protocol = header_timeout_protocol(ns.request_header_timeout, lambda: app.state.metrics.record_rejected(408))
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on", http=protocol)
    server = Server(config)
    drain = _Drain(app.state.serving, async_engine, server, ns.shutdown_timeout)
    # uvicorn re-raises the signal it caught once it has shut down; these handlers turn that into a clean exit.
    received: list[int] = []
    handler: Callable[[int, Any], None] = lambda sig, frame: received.append(sig)  # noqa: E731
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    print(f"kv8: serving {limits.served_model_name!r} on http://{ns.host}:{ns.port}/v1 "
          f"(kv_cache_dtype={cfg.cache.kv_dtype.name}, API key {'required' if api_key else 'not required'})",
          flush=True)
    server.run()
    if failures:
        return 1
    if not server.started:
        raise ValueError(f"could not start the server on {ns.host}:{ns.port} (see the log above)")
    print("kv8: server stopped", flush=True)
    return 0


