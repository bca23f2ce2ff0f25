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

Differences from ``kv8 serve``: Serve's proxy owns the HTTP connection, so ``--request-header-timeout`` and
``--allowed-origins`` are not supported (an error names them); ``--shutdown-timeout`` is the replicas' graceful
shutdown timeout. On SIGINT/SIGTERM the application is deleted and, if kv8 started the Ray cluster, Ray is shut
down; a cluster given by address keeps running. A cluster kv8 starts is a new one even beside another on the host,
with the settings of :func:`own_cluster_environment` (token in the environment only, Ray's memory killer off), its
node on the loopback and its files in a private directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, NoReturn

from kv8.engine.args import EngineArgs
from kv8.entrypoints.dp.ingress import IngressSpec, KV8Ingress
from kv8.entrypoints.dp.replica import KV8Replica, ReplicaSpec
from kv8.entrypoints.openai.cli_args import ServerArgs, add_serve_args

APP_NAME = "kv8"
CONTROL_MARGIN = 16       # Serve calls a replica takes beyond its request limit (pings, metrics)
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
QUIET = {"log_level": "WARNING", "enable_access_log": False}   # Serve's logging: warnings and errors only


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
    def from_args(cls, server: ServerArgs, engine_args: EngineArgs) -> DataParallelPlan:
        if server.data_parallel_backend != "ray":
            raise ValueError(f"--data-parallel-backend={server.data_parallel_backend!r} is not supported; kv8 runs "
                             "data parallel replicas on Ray only: add --data-parallel-backend ray")
        if engine_args.tensor_parallel_size != 1:
            raise ValueError(f"--tensor-parallel-size={engine_args.tensor_parallel_size} with --data-parallel-backend "
                             "ray is not supported: each replica is one process; use --tensor-parallel-size 1")
        size = server.data_parallel_size
        threads = engine_args.cpu_threads_per_rank or max(1, (os.cpu_count() or 1) // size)
        replicas = tuple(ReplicaSpec(i, engine_args, server, threads) for i in range(size))
        ingress = IngressSpec(size, server.model_name(engine_args.model), server.resolved_api_key(), server)
        return cls(replicas, ingress, server.host, server.port, server.resolved_ray_address(), server.shutdown_timeout,
                   engine_args.max_num_seqs + server.max_waiting_requests + CONTROL_MARGIN)

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


class _BuilderParser(argparse.ArgumentParser):
    """argparse that raises ``ValueError`` (Serve shows it) instead of exiting the controller."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"serve run kv8.entrypoints.dp.app:app_builder: {message}")


def app_builder(args: Mapping[str, Any]) -> Any:
    """The application for ``serve run kv8.entrypoints.dp.app:app_builder key=value ...`` or a Serve config
    file: ``args`` are ``kv8 serve`` flags by their names (``model``, ``data_parallel_size``, ``kv_cache_dtype``,
    ``max_num_seqs`` ...; booleans as true/false), validated as the command line validates them. The HTTP
    address is Serve's (``serve run``'s / the config's ``http_options``)."""
    parser = _BuilderParser(prog="kv8.entrypoints.dp.app:app_builder")
    add_serve_args(parser, "--model", model_optional=True)
    flags = {f for a in parser._actions for f in a.option_strings}
    argv = ["--data-parallel-backend", "ray"]
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
    return DataParallelPlan.from_args(ServerArgs.from_cli_args(ns), EngineArgs.from_cli_args(ns)).application()


# ---- kv8 serve --data-parallel-backend ray -----------------------------------------------------------------------
def run_ray_server(server: ServerArgs, engine_args: EngineArgs) -> int:
    """Start the cluster (or join it), run the application, wait for SIGINT/SIGTERM, then tear down."""
    plan = DataParallelPlan.from_args(server, engine_args)
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
