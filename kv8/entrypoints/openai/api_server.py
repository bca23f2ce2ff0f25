"""``kv8 serve`` (alias ``kv8 run``): an OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: those of :data:`kv8.entrypoints.openai.routes.ROUTES` (``POST /v1/completions``, ``POST
/v1/chat/completions``, ``POST /v1/responses``, ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``)
and ``GET /v1/models``, all behind the API key when one is set; ``GET /health`` and ``GET /metrics`` (Prometheus
text) are open.

Every failure has OpenAI's error shape and a precise status: 408 for headers or a body that do not arrive within
``--request-header-timeout`` / ``--request-body-timeout`` seconds (:mod:`kv8.entrypoints.openai.http_protocol`,
:func:`kv8.entrypoints.openai.http.read_json_body`), 413 for a body over ``--max-request-bytes``, 400 for a body
that is not a JSON object or has wrong types, out-of-range values or unknown fields; 401 for a missing or wrong
API key, 404 for an unknown model or route, 503 when overloaded, draining or the engine is down.

Security defaults: binds 127.0.0.1 unless ``--host`` says otherwise; the API key (``--api-key`` or
``$KV8_API_KEY``) is compared in constant time; bodies, ``n`` and ``max_tokens`` are bounded; JSON only.

Shutdown (:class:`_Drain`): on SIGTERM/SIGINT the server drains: it keeps accepting connections, and new requests
get 503 ``shutting_down`` with ``Retry-After`` (``/health`` too), while in-flight requests run to completion for
up to ``--shutdown-timeout`` seconds and are then aborted (a stream ends with an error event and ``data: [DONE]``,
a non-streaming request gets a JSON 503). A second signal aborts them at once, the same way. Once no request is in
flight, uvicorn stops accepting and shuts down, the engine thread stops and the process exits 0 (uvicorn
re-raises the signal after shutting down; kv8's handlers absorb it). A third signal forces uvicorn out.

A request that ends in a 5xx (a 500 ``generation_failed``: ``finish_reason="error"``; a 503) leaves one log line
with its id, route and reason; its error answer carries the id as ``X-Request-Id``.

Engine failure: a failure that leaves the engine unusable (an exception escaping an engine step; one request's
failure does not) fails every open request with a 503, makes ``/health`` answer 503 with the error, prints one
``kv8: error:`` line and exits the process with status 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kv8.engine.args import EngineArgs
from kv8.engine.async_engine import AsyncEngine
from kv8.entrypoints.openai.cli_args import ServerArgs
from kv8.entrypoints.openai.http import (
    SSEResponse,
    check_api_key,
    install_error_handlers,
    models_response,
    read_json_body,
    wait_disconnect,
)
from kv8.entrypoints.openai.metrics import ServerMetrics
from kv8.entrypoints.openai.protocol import APIError
from kv8.entrypoints.openai.request_run import ClientDisconnected, Stream
from kv8.entrypoints.openai.routes import Route, enabled_routes
from kv8.entrypoints.openai.serving import OpenAIServing, ServingLimits

if TYPE_CHECKING:
    from kv8.engine.engine import LLMEngine

logger = logging.getLogger("kv8.server")

RETRY_AFTER_SHUTDOWN_S = 5   # the Retry-After of a 503 answered while the server drains


def build_app(engine: AsyncEngine, limits: ServingLimits, args: ServerArgs | None = None,
              api_key: str | None = None) -> FastAPI:
    """The ASGI app of ``engine`` with the server options ``args`` (defaults if None) and the resolved
    ``api_key`` (None: no key). ``app.state.draining`` set to True makes new /v1 requests answer 503;
    ``app.state.metrics`` is its :class:`ServerMetrics`."""
    args = args if args is not None else ServerArgs()
    metrics = ServerMetrics()
    serving = OpenAIServing(engine, limits, metrics, tool_options=args.tool_options)

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
    if args.allowed_origins:  # CORS is off unless origins are named: no browser page may read kv8's answers
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(args.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    def gone(request: Request, e: ClientDisconnected) -> None:
        metrics.record_disconnect(e.stage)
        if e.stage == "upload":   # nothing was generated yet: worth one line, not a traceback
            logger.warning("client went away during the request body upload (%s %s, %s)", request.method,
                           request.url.path, e.detail)

    error_response = install_error_handlers(app, metrics.record_rejected, gone)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("request - (%s) failed: 500 internal error", request.url.path)
        return error_response(APIError(500, f"internal server error: {type(e).__name__}: {e}", type_="server_error"))

    def check_access(request: Request) -> None:
        check_api_key(request, api_key)
        if app.state.draining:
            raise APIError(503, "the server is shutting down; retry on another instance or once it restarted",
                           type_="server_error", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_SHUTDOWN_S)})
        if not engine.is_running:
            raise APIError(503, "the engine is not running", type_="server_error", code="engine_unavailable")

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

    def endpoint(route: Route) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            """Check the key, read the bounded JSON body, validate it strictly (errors become 4xx), answer."""
            check_access(request)
            body = {} if route.request is None else await read_json_body(request, args.max_request_bytes,
                                                                          args.request_body_timeout)
            result = await route.answer(serving, route.parse(body), lambda: wait_disconnect(request))
            return SSEResponse(result) if isinstance(result, Stream) else JSONResponse(result)
        return answer

    for route in enabled_routes(args):
        app.add_api_route(route.path, endpoint(route), methods=[route.method])
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


def serving_limits(llm: LLMEngine, args: ServerArgs, model: str) -> ServingLimits:
    """The per-request limits of a server on ``llm`` (``ValueError`` if ``--max-tokens-limit`` exceeds the
    context); ``model`` is the model argument, the name clients use unless ``--served-model-name`` says."""
    cfg = llm.config
    max_model_len = cfg.scheduler.max_model_len
    if args.max_tokens_limit is not None and args.max_tokens_limit > max_model_len:
        raise ValueError(f"--max-tokens-limit={args.max_tokens_limit} exceeds max_model_len={max_model_len}")
    return ServingLimits(
        served_model_name=args.model_name(model), max_model_len=max_model_len,
        max_tokens=args.max_tokens_limit or max_model_len, max_n=args.max_n,
        max_in_flight=cfg.scheduler.max_num_seqs + args.max_waiting_requests,
        kv_capacity_tokens=llm.stats().kv_capacity_tokens, kv_block_size=cfg.cache.block_size)


def run_server(args: ServerArgs, engine_args: EngineArgs) -> int:
    import uvicorn

    from kv8.engine.engine import LLMEngine
    from kv8.entrypoints.openai.http_protocol import header_timeout_protocol

    api_key = args.resolved_api_key()
    llm = LLMEngine(engine_args)
    cfg = llm.config
    limits = serving_limits(llm, args, engine_args.model)

    failures: list[BaseException] = []

    def engine_failed(error: BaseException) -> None:
        """The engine cannot serve any more: say so once and stop the server; run_server then returns 1."""
        failures.append(error)
        print(f"kv8: error: the engine failed and cannot serve any more requests ({type(error).__name__}: "
              f"{error}); exiting with status 1 so that a supervisor can restart kv8", file=sys.stderr, flush=True)
        server.should_exit = True

    async_engine = AsyncEngine(llm, on_failure=engine_failed)
    app = build_app(async_engine, limits, args, api_key)

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

    protocol = header_timeout_protocol(args.request_header_timeout, lambda: app.state.metrics.record_rejected(408))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on", http=protocol)
    server = Server(config)
    drain = _Drain(app.state.serving, async_engine, server, args.shutdown_timeout)
    # uvicorn re-raises the signal it caught once it has shut down; these handlers turn that into a clean exit.
    received: list[int] = []
    handler: Callable[[int, Any], None] = lambda sig, frame: received.append(sig)  # noqa: E731
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    print(f"kv8: serving {limits.served_model_name!r} on http://{args.host}:{args.port}/v1 "
          f"(kv_cache_dtype={cfg.cache.default_spec.name}, API key {'required' if api_key else 'not required'})",
          flush=True)
    server.run()
    if failures:
        return 1
    if not server.started:
        raise ValueError(f"could not start the server on {args.host}:{args.port} (see the log above)")
    print("kv8: server stopped", flush=True)
    return 0


