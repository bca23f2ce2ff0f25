"""Data-parallel kv8 on Ray Serve: N engine replicas, each with its own KV cache, behind one OpenAI endpoint.

``kv8 serve MODEL --data-parallel-size N --data-parallel-backend ray [--ray-address ADDR]`` starts (or joins, with
``--ray-address`` / ``$RAY_ADDRESS``) a Ray cluster and runs one Serve application, ``kv8``, made of:

* ``kv8-replica-0`` .. ``kv8-replica-{N-1}``: N deployments of one replica each (:class:`KV8Replica`). A replica
  is an :class:`AsyncEngine` plus the same :class:`OpenAIServing` as ``kv8 serve``, so every OpenAI feature
  behaves as there; it pins its torch threads (``--cpu-threads-per-rank``, default: the cores divided by N) and
  reserves as many Ray CPUs, so N replicas share the cores without oversubscription.
* ``kv8-ingress``: a FastAPI app (:class:`KV8Ingress`, behind Serve's HTTP proxy) with the routes of ``kv8
  serve``. It checks the API key, reads the bounded JSON body, picks a replica with
  :class:`kv8.entrypoints.dp.router.PrefixRouter` (prefix-cache affinity, balanced by load, else least loaded)
  and relays the answer: JSON, or SSE chunks as the replica streams them.

Why N one-replica deployments routed by the ingress, rather than one N-replica deployment with a custom Serve
``RequestRouter``: the ingress then knows exactly which replica holds which prefix and how many requests each
has in flight (the routing table is plain Python, tested without Ray), can address one replica to scrape its
metrics or probe it, and stops routing to a replica the moment a call to it fails, instead of queueing behind
Serve's view of the replica set. Serve still health-checks and restarts each replica.

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

Differences from ``kv8 serve``: Serve's proxy owns the HTTP connection, so ``--request-header-timeout`` and
``--allowed-origins`` are not supported (an error names them); ``--shutdown-timeout`` is the replicas' graceful
shutdown timeout. On SIGINT/SIGTERM the application is deleted and, if kv8 started the Ray cluster, Ray is shut
down; a cluster given by address keeps running. A cluster kv8 starts is a new one even beside another on the host,
with the settings of :func:`own_cluster_environment` (token in the environment only, Ray's memory killer off), its
node on the loopback and its files in a private directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kv8 import envs
from kv8.engine.args import EngineArgs
from kv8.entrypoints.cli import REQUEST_HEADER_TIMEOUT_S
from kv8.entrypoints.dp.metrics import merge_replica_metrics, render_router_metrics
from kv8.entrypoints.dp.replica import JSONReply, KV8Replica, ReplicaInfo, ReplicaSpec
from kv8.entrypoints.dp.router import PrefixRouter, RouterConfig, routing_text
from kv8.entrypoints.openai.api_server import (
    ServerOptions,
    SSEResponse,
    check_api_key,
    check_server_args,
    install_error_handlers,
    models_response,
    read_json_body,
)
from kv8.entrypoints.openai.protocol import APIError
from kv8.entrypoints.openai.request_run import Stream, sse
from kv8.validators import check_int

logger = logging.getLogger("kv8.ray_serve")

APP_NAME = "kv8"
PROBE_PERIOD_S = 1.0      # how often the ingress pings its replicas
PING_TIMEOUT_S = 10.0     # a replica that does not answer a ping within this is marked down
CONTROL_MARGIN = 16       # Serve calls a replica takes beyond its request limit (pings, metrics)
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
QUIET = {"log_level": "WARNING", "enable_access_log": False}   # Serve's logging: warnings and errors only


# ---- the ingress ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IngressSpec:
    """The ingress's settings (picklable)."""

    num_replicas: int
    served_model_name: str
    api_key: str | None
    max_request_bytes: int
    body_timeout: float
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

        return SSEResponse(Stream(self._relay(replica, gen), close))

    def _failure(self, replica: int, e: BaseException) -> APIError:
        if _is_replica_failure(e):   # StopAsyncIteration (no answer at all) included
            self.mark_down(replica, e)
            return APIError(503, f"replica {replica} failed while serving the request ({type(e).__name__}); "
                                 "retry: new requests go to the replicas that are up", type_="server_error",
                            code="replica_failed", headers={"Retry-After": "1"})
        logger.error("replica %d: %s: %s", replica, type(e).__name__, e)
        return APIError(500, f"internal server error: {type(e).__name__}: {e}", type_="server_error")

    async def _relay(self, replica: int, gen: Any) -> AsyncIterator[str]:
        try:
            async for chunk in gen:
                yield chunk
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream ends with an error event, never a hang
            err = self._failure(replica, e)
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

    def forwarder(route: str) -> Callable[[Request], Awaitable[Response]]:
        async def forward(request: Request) -> Response:
            check_key(request)
            body = await read_json_body(request, spec.max_request_bytes, spec.body_timeout)
            return await ingress.forward(route, body)
        return forward

    for path, route in (("/v1/completions", "completions"), ("/v1/chat/completions", "chat"),
                        ("/tokenize", "tokenize"), ("/detokenize", "detokenize")):
        app.add_api_route(path, forwarder(route), methods=["POST"])

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        check_key(request)
        return await ingress.forward("tokenizer_info", {})

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


# ---- the application ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataParallelPlan:
    """A validated data-parallel server: the replicas' and the ingress's specs, the HTTP address and the Ray
    cluster. Built by :meth:`from_args` (``ValueError`` naming the flag for what is not supported)."""

    replicas: tuple[ReplicaSpec, ...]
    ingress: IngressSpec
    host: str
    port: int
    ray_address: str | None
    shutdown_timeout: float
    max_ongoing_requests: int

    @classmethod
    def from_args(cls, ns: argparse.Namespace, engine_args: EngineArgs) -> DataParallelPlan:
        size = ns.data_parallel_size
        check_int("--data-parallel-size", size, 1)
        if ns.data_parallel_backend != "ray":
            raise ValueError(f"--data-parallel-backend={ns.data_parallel_backend!r} is not supported; kv8 runs data "
                             "parallel replicas on Ray only: add --data-parallel-backend ray")
        if engine_args.tensor_parallel_size != 1:
            raise ValueError(f"--tensor-parallel-size={engine_args.tensor_parallel_size} with --data-parallel-backend "
                             "ray is not supported: each replica is one process; use --tensor-parallel-size 1")
        if ns.allowed_origins:
            raise ValueError("--allowed-origins is not supported with --data-parallel-backend ray (Serve's proxy "
                             "serves HTTP)")
        if ns.request_header_timeout != REQUEST_HEADER_TIMEOUT_S:
            raise ValueError("--request-header-timeout is not supported with --data-parallel-backend ray (Serve's "
                             "proxy reads the headers)")
        api_key = check_server_args(ns)
        threads = engine_args.cpu_threads_per_rank or max(1, (os.cpu_count() or 1) // size)
        server = ServerOptions.from_namespace(ns, engine_args.model)
        replicas = tuple(ReplicaSpec(i, engine_args, server, threads) for i in range(size))
        ingress = IngressSpec(size, server.served_model_name, api_key, ns.max_request_bytes, ns.request_body_timeout)
        max_num_seqs = engine_args.max_num_seqs
        return cls(replicas, ingress, ns.host, ns.port, ns.ray_address or envs.ray_address(), ns.shutdown_timeout,
                   max_num_seqs + ns.max_waiting_requests + CONTROL_MARGIN)

    def application(self) -> Any:
        """The Serve application (``serve.run`` it)."""
        from ray import serve

        handles = []
        for spec in self.replicas:
            deployment: Any = serve.deployment(KV8Replica)
            deployment = deployment.options(
                name=f"kv8-replica-{spec.index}", num_replicas=1,
                ray_actor_options={"num_cpus": spec.threads,
                                   "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(spec.threads),
                                                                "TOKENIZERS_PARALLELISM": "false"}}},
                max_ongoing_requests=self.max_ongoing_requests, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S, graceful_shutdown_timeout_s=self.shutdown_timeout)
            handles.append(deployment.bind(spec))
        ingress: Any = serve.deployment(serve.ingress()(KV8Ingress))
        ingress = ingress.options(
            name="kv8-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=len(self.replicas) * self.max_ongoing_requests)
        return ingress.bind(self.ingress, *handles)


def app_builder(args: Mapping[str, Any]) -> Any:
    """The application for ``serve run kv8.entrypoints.dp.app:app_builder key=value ...`` or a Serve config
    file: ``args`` are ``kv8 serve`` flags by their names (``model``, ``data_parallel_size``, ``kv_cache_dtype``,
    ``max_num_seqs`` ...; booleans as true/false), validated as the command line validates them. The HTTP
    address is Serve's (``serve run``'s / the config's ``http_options``)."""
    from kv8.entrypoints.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {f for a in subparsers.choices["serve"]._actions for f in a.option_strings}
    argv = ["serve", "--data-parallel-backend", "ray"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if isinstance(value, bool):   # --x / --no-x, or a --x that is off unless given
            negative = "--no-" + flag[2:]
            argv += [flag] if value else [negative] if negative in flags else []
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    ns = parser.parse_args(argv)
    return DataParallelPlan.from_args(ns, EngineArgs.from_cli_args(ns)).application()


# ---- kv8 serve --data-parallel-backend ray -----------------------------------------------------------------------
def run_ray_server(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    """Start the cluster (or join it), run the application, wait for SIGINT/SIGTERM, then tear down."""
    plan = DataParallelPlan.from_args(ns, engine_args)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # a local cluster reports nothing home
    own_cluster = plan.ray_address is None
    if own_cluster:   # before Ray loads: its C++ side reads the authentication settings once
        own_cluster_environment(os.environ)
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError(f"--data-parallel-backend ray needs Ray Serve ({e}); install it with "
                         "pip install 'kv8[ray]'") from e

    stop = threading.Event()
    received: list[int] = []

    def on_signal(sig: int, frame: Any) -> None:
        received.append(sig)
        stop.set()

    previous: dict[int, Callable[..., Any] | int | None] = {
        s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    cores = sum(s.threads for s in plan.replicas)
    private_dir = None
    try:
        if own_cluster:
            private_dir = tempfile.mkdtemp(prefix="kv8-ray-")   # 0700: Ray makes its own temp dir 0777 inside
            # address="local": always a new cluster, even when one was started on this host (ray.init would join
            # it and then refuse num_cpus); its node address is the loopback
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, cores), include_dashboard=False,
                     _node_ip_address="127.0.0.1", _temp_dir=os.path.join(private_dir, "ray"),
                     logging_level=logging.WARNING)
        else:
            try:
                ray.init(address=plan.ray_address, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise ValueError(f"could not connect to the Ray cluster at {plan.ray_address} (--ray-address or "
                                 f"$RAY_ADDRESS): {e}; a cluster with token authentication also needs "
                                 "RAY_AUTH_MODE=token and its token (~/.ray/auth_token or $RAY_AUTH_TOKEN)") from e
        for sig in previous:   # ray.init installs its own SIGTERM handler, which exits without tearing down
            signal.signal(sig, on_signal)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        serve.start(http_options={"host": plan.host, "port": plan.port}, logging_config=QUIET)
        print(f"kv8: starting {len(plan.replicas)} replicas of {plan.ingress.served_model_name!r} on Ray "
              f"({'a new local cluster' if own_cluster else plan.ray_address}), {plan.replicas[0].threads} "
              "threads each", flush=True)
        serve.run(plan.application(), name=APP_NAME, route_prefix="/", logging_config=QUIET)
        print(f"kv8: serving {plan.ingress.served_model_name!r} on http://{plan.host}:{plan.port}/v1 "
              f"({len(plan.replicas)} data-parallel replicas on Ray, API key "
              f"{'required' if plan.ingress.api_key else 'not required'})", flush=True)
        while not stop.wait(0.5):
            pass
        print("kv8: stopping the replicas", flush=True)
    finally:
        try:
            if ray.is_initialized():
                if own_cluster:
                    serve.shutdown()
                else:
                    serve.delete(APP_NAME)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            if private_dir is not None:
                shutil.rmtree(private_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print("kv8: server stopped", flush=True)
    return 0


def own_cluster_environment(env: MutableMapping[str, str]) -> None:
    """The settings of the Ray cluster kv8 starts itself, set in ``env`` (the environment Ray's processes inherit)
    unless the user set them:

    * token authentication with a fresh random token kept in the environment only (``RAY_AUTH_TOKEN``): Ray's
      gRPC servers listen on every interface (Ray 2.60 has no option to bind them to the loopback), so calls
      without the token are refused; left to itself Ray would write the token to ``~/.ray/auth_token`` with the
      umask's mode (world-readable under the usual 022);
    * Ray's out-of-memory killer off (``RAY_memory_monitor_refresh_ms=0``): above 95% of the node's memory it
      kills Ray workers -- the controller, the ingress and the replicas, whose memory is fixed at start (weights
      and the KV cache budget) -- whatever process is using the memory, which took the whole application down
      twice a minute on a busy host while freeing nothing of the culprit's. The kernel's OOM killer remains for
      a machine truly out of memory.
    """
    env.setdefault("RAY_memory_monitor_refresh_ms", "0")
    if env.setdefault("RAY_AUTH_MODE", "token").lower() == "token" and not (
            env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH")):
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
