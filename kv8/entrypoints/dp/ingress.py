"""The data-parallel ingress: one FastAPI app (behind Serve's HTTP proxy) that serves the OpenAI routes of ``kv8
serve`` (:data:`kv8.entrypoints.openai.routes.ROUTES`) by relaying each request to one of N replicas, chosen by
:class:`kv8.entrypoints.dp.router.PrefixRouter` (prefix-cache affinity balanced by load, else least loaded); it
checks the API key and reads the bounded JSON body itself and relays the answer: JSON, or SSE chunks as the
replica streams them.

Each request is one streaming call of :meth:`KV8Replica.handle` (:mod:`kv8.entrypoints.dp.replica` states the
protocol). A client that goes away makes Serve's proxy cancel the ingress request, whose replica call is then
cancelled, which aborts the engine requests.

Faults: a call that fails because its replica failed (the process was killed, Ray's memory monitor killed it, Ray
reports it unavailable, no answer; anything but an exception of kv8's code in it: :func:`_is_replica_failure`)
answers a 503 ``replica_failed`` (a stream: an error event, then ``data: [DONE]``); the ingress marks the
replica down and forgets its prefixes, routes new requests to the others, and probes it every
:data:`PROBE_PERIOD_S` seconds until Serve's replacement answers, which rejoins with an empty cache. A replica
whose engine failed answers 503 and fails its health check, so Serve replaces it. Replicas that are up are
pinged as well, so a replica that died idle is noticed within :data:`PING_TIMEOUT_S` seconds.

``/health`` answers 200 while at least one replica is up (503 otherwise), with each replica's state and process id;
``/metrics`` merges the replicas' metrics (:mod:`kv8.entrypoints.dp.metrics`) and adds the router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kv8.entrypoints.dp.metrics import merge_replica_metrics, render_router_metrics
from kv8.entrypoints.dp.replica import JSONReply, ReplicaInfo
from kv8.entrypoints.dp.router import PrefixRouter, RouterConfig, routing_text
from kv8.entrypoints.openai.cli_args import ServerArgs
from kv8.entrypoints.openai.http import (
    SSEResponse,
    check_api_key,
    install_error_handlers,
    models_response,
    read_json_body,
)
from kv8.entrypoints.openai.protocol import APIError
from kv8.entrypoints.openai.request_run import Stream, log_failure, sse
from kv8.entrypoints.openai.routes import ROUTE_BY_NAME, Route, enabled_routes

logger = logging.getLogger("kv8.ray_serve")

PROBE_PERIOD_S = 1.0      # how often the ingress pings its replicas
PING_TIMEOUT_S = 10.0     # a replica that does not answer a ping within this is marked down


# ---- the ingress ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IngressSpec:
    """The ingress's settings (picklable): the server options, with the served name and API key resolved."""

    num_replicas: int
    served_model_name: str
    api_key: str | None
    server: ServerArgs = ServerArgs()
    router: RouterConfig = RouterConfig()


def _is_replica_failure(e: BaseException) -> bool:
    """Whether ``e`` (raised by a call to a replica) means the replica failed, not kv8's code in it. A replica
    answers every request error itself (:meth:`KV8Replica.handle`: a JSON error or an error event), so what a
    call raises is the replica's process or Ray's transport failing -- an actor that died, was killed by Ray's
    memory monitor (``OutOfMemoryError``), is unreachable or timed out -- except a ``RayTaskError``, which
    wraps an exception kv8's code raised inside the replica."""
    from ray.exceptions import RayTaskError

    return not isinstance(e, RayTaskError)


class KV8Ingress:
    """Routes OpenAI requests over the replicas (see the module docstring). State lives on its event loop."""

    def __init__(self, spec: IngressSpec, *replicas: Any) -> None:
        if len(replicas) != spec.num_replicas:
            raise ValueError(f"{len(replicas)} replica handles for num_replicas={spec.num_replicas}")
        self.spec = spec
        self.streams = [h.options(stream=True, method_name="handle") for h in replicas]
        self.handles = list(replicas)
        self.router = PrefixRouter(spec.router)
        n = spec.num_replicas
        self.up = dict.fromkeys(range(n), True)    # serve.run returned: every replica is running
        self.in_flight = dict.fromkeys(range(n), 0)
        self.failures = dict.fromkeys(range(n), 0)
        self.routed: dict[tuple[int, str], int] = {}
        self.rejected: dict[int, int] = {}
        self.info: dict[int, ReplicaInfo] = {}
        self._prober: asyncio.Task[None] | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    # ---- replica state ----------------------------------------------------------------------------------------
    def ensure_prober(self) -> None:
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    def mark_down(self, replica: int, why: BaseException | str) -> None:
        if self.up[replica]:
            first_line = next(iter(str(why).splitlines()), "") if not isinstance(why, str) else why
            reason = why if isinstance(why, str) else f"{type(why).__name__}: {first_line or 'no message'}"
            logger.warning("replica %d is down (%s); routing to the others until it answers again", replica, reason)
            self.up[replica] = False
            self.failures[replica] += 1
        self.router.forget(replica)

    async def _probe(self, replica: int) -> None:
        try:
            info = await asyncio.wait_for(self.handles[replica].info.remote(), PING_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means down
            self.mark_down(replica, e if not isinstance(e, asyncio.TimeoutError) else
                           f"no answer to a ping within {PING_TIMEOUT_S:g} s")
            return
        old = self.info.get(replica)
        self.info[replica] = info
        if not self.up[replica] or (old is not None and old.pid != info.pid):
            logger.warning("replica %d is up (pid %d)", replica, info.pid)
            self.router.forget(replica)   # a new process: its cache is empty
            self.up[replica] = True

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(r) for r in self.up))
            await asyncio.sleep(PROBE_PERIOD_S)

    # ---- requests ---------------------------------------------------------------------------------------------
    async def forward(self, route: str, body: dict[str, Any]) -> Response:
        """Route one request and relay its answer."""
        self.ensure_prober()
        loads = {r: self.in_flight[r] for r, ok in self.up.items() if ok}
        if not loads:
            raise APIError(503, "no replica is up; retry once Ray has restarted one", type_="server_error",
                           code="no_replica_available", headers={"Retry-After": "5"})
        decision = self.router.choose(routing_text(route, body), loads)
        replica = decision.replica
        key = (replica, decision.reason)
        self.routed[key] = self.routed.get(key, 0) + 1
        self.in_flight[replica] += 1
        gen = self.streams[replica].remote(route, body)
        try:
            first = await gen.__anext__()
        except BaseException as e:
            self.in_flight[replica] -= 1
            with contextlib.suppress(Exception):   # cancelling a call whose replica is gone raises too
                gen.cancel()
            if not isinstance(e, Exception):   # cancelled (the client went away), or the process is exiting
                raise
            raise self._failure(replica, e) from e
        if isinstance(first, JSONReply):
            self.in_flight[replica] -= 1
            return JSONResponse(first.body, status_code=first.status, headers=first.headers)
        closed = False

        def close() -> None:   # however the response ends, even before its first chunk: once
            nonlocal closed
            if not closed:
                closed = True
                self.in_flight[replica] -= 1
                with contextlib.suppress(Exception):
                    gen.cancel()

        return SSEResponse(Stream(self._relay(route, replica, gen), close))

    def _failure(self, replica: int, e: BaseException) -> APIError:
        if _is_replica_failure(e):   # StopAsyncIteration (no answer at all) included
            self.mark_down(replica, e)
            return APIError(503, f"replica {replica} failed while serving the request ({type(e).__name__}); "
                                 "retry: new requests go to the replicas that are up", type_="server_error",
                            code="replica_failed", headers={"Retry-After": "1"})
        return APIError(500, f"internal server error in replica {replica}: {type(e).__name__}: {e}",
                        type_="server_error")

    async def _relay(self, route: str, replica: int, gen: Any) -> AsyncIterator[str]:
        try:
            async for chunk in gen:
                yield chunk
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream ends with an error event, never a hang
            err = self._failure(replica, e)
            log_failure(ROUTE_BY_NAME[route].path, err)   # (errors that are not streamed: the error handler's)
            yield sse(err.body())
            yield "data: [DONE]\n\n"

    async def replica_info(self) -> ReplicaInfo:
        for r, ok in self.up.items():
            if ok and r in self.info:
                return self.info[r]
        for r, ok in self.up.items():
            if ok:
                try:
                    self.info[r] = await asyncio.wait_for(self.handles[r].info.remote(), PING_TIMEOUT_S)
                    return self.info[r]
                except Exception as e:  # noqa: BLE001
                    self.mark_down(r, e)
        raise APIError(503, "no replica is up", type_="server_error", code="no_replica_available")

    async def metrics_text(self) -> str:
        async def one(r: int) -> str | None:
            try:
                text: str = await asyncio.wait_for(self.handles[r].metrics_text.remote(), PING_TIMEOUT_S)
                return text
            except Exception as e:  # noqa: BLE001 - a replica that cannot answer is left out and marked down
                self.mark_down(r, e)
                return None
        up = [r for r, ok in self.up.items() if ok]
        texts = dict(zip(up, await asyncio.gather(*(one(r) for r in up))))
        merged = merge_replica_metrics({r: t for r, t in texts.items() if t is not None})
        return merged + render_router_metrics(self.up, self.in_flight, self.routed, self.failures, self.rejected)


def build_ingress_app(ingress: KV8Ingress) -> FastAPI:
    """The ingress's routes: those of ``kv8 serve``, each forwarded to a replica (the engine-free ones too)."""
    spec = ingress.spec
    app = FastAPI(title="kv8 (data parallel)", docs_url=None, redoc_url=None, openapi_url=None)

    def rejected(status: int) -> None:
        ingress.rejected[status] = ingress.rejected.get(status, 0) + 1

    install_error_handlers(app, rejected, lambda request, e: None)

    def check_key(request: Request) -> None:
        check_api_key(request, spec.api_key)

    def forwarder(route: Route) -> Callable[[Request], Awaitable[Response]]:
        async def forward(request: Request) -> Response:
            check_key(request)
            body = {} if route.request is None else await read_json_body(request, spec.server.max_request_bytes,
                                                                          spec.server.request_body_timeout)
            return await ingress.forward(route.name, body)
        return forward

    for route in enabled_routes(spec.server):
        app.add_api_route(route.path, forwarder(route), methods=[route.method])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_key(request)
        info = await ingress.replica_info()
        return models_response(spec.served_model_name, info.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        ingress.ensure_prober()
        replicas = [{"replica": r, "up": ok, "pid": ingress.info[r].pid if r in ingress.info else None,
                     "node": ingress.info[r].node if r in ingress.info else None}
                    for r, ok in ingress.up.items()]
        up = sum(ingress.up.values())
        status = "ok" if up == len(replicas) else f"{up} of {len(replicas)} replicas up"
        return JSONResponse({"status": status, "replicas": replicas}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        ingress.ensure_prober()
        return PlainTextResponse(await ingress.metrics_text(), media_type="text/plain; version=0.0.4")

    return app
