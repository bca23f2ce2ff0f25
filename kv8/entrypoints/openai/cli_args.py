"""The options of ``kv8 serve`` (alias ``kv8 run``) that are not engine options: the HTTP server's and the data-parallel
ones (vLLM's names), each declared once as a field of :class:`ServerArgs`.

The flags are generated from the fields (:class:`kv8.options.OptionGroup`), ``serve run`` / a Serve config file
passes the same names (:func:`kv8.entrypoints.dp.app.app_builder`), and :meth:`ServerArgs.__post_init__` is the one
validation: a bad value raises ``ValueError`` naming the flag, the value and what is allowed. The single server
(:mod:`kv8.entrypoints.openai.api_server`), the data-parallel ingress and each replica read the same value (it
is frozen and picklable).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kv8 import envs
from kv8.engine.args import EngineArgs
from kv8.entrypoints.openai.tool_calling import ToolOptions
from kv8.options import OptionGroup, from_config, option
from kv8.validators import check_choice, check_int, check_number

REQUEST_HEADER_TIMEOUT_S = 30.0            # --request-header-timeout's default (Serve's proxy reads the headers)
DATA_PARALLEL_BACKENDS = ("mp", "ray")    # vLLM's choices of --data-parallel-backend; kv8 runs replicas on ray
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SERVER_FLAG_ALIASES = {"data_parallel_size": ("-dp",), "data_parallel_backend": ("-dpb",)}   # vLLM's short flags


@dataclass(frozen=True)
class ServerArgs(OptionGroup):
    """Server and data-parallel options. Invariants after construction: every limit is positive, the port is a
    port, the tool options go together, and a data-parallel size above 1 names the ray backend, without the two
    options Serve's HTTP proxy does not offer."""

    cli_group_title = "server and data parallel (ServerArgs)"

    host: str = option("127.0.0.1", "address to bind; 127.0.0.1 is the loopback only")
    port: int = option(8000, "port", type=int)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1 routes (default: $KV8_API_KEY "
                                 "if set)")
    served_model_name: str | None = option(None, "model name clients use (default: the model argument)")
    max_n: int = option(16, "largest n per request", type=int)
    max_tokens_limit: int | None = option(None, "largest max_tokens per request (default: max_model_len)", type=int)
    max_request_bytes: int = option(4 * 1024 * 1024, "largest request body in bytes", type=int)
    max_waiting_requests: int = option(256, "sequences that may wait beyond --max-num-seqs before new requests get "
                                       "503", type=int)
    shutdown_timeout: float = option(30.0, "seconds in-flight requests may run after SIGTERM/SIGINT before they are "
                                     "aborted", type=float)
    request_header_timeout: float = option(REQUEST_HEADER_TIMEOUT_S, "a request's line and headers must arrive "
                                           "within this many seconds, else 408", type=float, metavar="SECONDS")
    request_body_timeout: float = option(60.0, "a request's whole body must arrive within this many seconds, else "
                                         "408", type=float, metavar="SECONDS")
    allowed_origins: tuple[str, ...] = option((), "browser origins allowed by CORS, e.g. http://localhost:3000, or "
                                              "* for any (default: none, CORS off)", metavar="ORIGIN", nargs="+")
    enable_auto_tool_choice: bool = from_config(ToolOptions, "enable_auto_tool_choice")
    tool_call_parser: str | None = from_config(ToolOptions, "tool_call_parser")
    enable_tokenizer_info_endpoint: bool = option(True, "serve GET /tokenizer_info (the tokenizer's configuration "
                                                  "and chat template, which lm-eval's remote tokenizer reads); "
                                                  "vLLM's flag, on by default in kv8", type=bool)
    log_level: str = option("warning", "uvicorn log level", choices=LOG_LEVELS)
    data_parallel_size: int = option(1, "engine replicas, each with its own KV cache, behind one endpoint (more "
                                     "than 1 needs --data-parallel-backend ray)", type=int)
    data_parallel_backend: str = option("mp", "where the replicas run: ray = Ray Serve; kv8 has no mp "
                                        "data-parallel backend, so mp (the default, as in vLLM) serves one engine "
                                        "in this process", choices=DATA_PARALLEL_BACKENDS)
    ray_address: str | None = option(None, "the Ray cluster to run the replicas on, e.g. 10.0.0.1:6379 (default: "
                                     "$RAY_ADDRESS, else a new local cluster)", metavar="ADDR")

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))   # a list from argparse
        for name in ("max_n", "max_request_bytes", "data_parallel_size"):
            check_int(self.flag(name), getattr(self, name), 1)
        check_int("--max-tokens-limit", self.max_tokens_limit, 1, optional=True)
        check_int("--max-waiting-requests", self.max_waiting_requests, 0)
        check_int("--port", self.port, 0, 65535)
        for name in ("shutdown_timeout", "request_header_timeout", "request_body_timeout"):
            check_number(self.flag(name), getattr(self, name), 0, exclusive_minimum=True)
        check_choice("--log-level", self.log_level, LOG_LEVELS)
        check_choice("--data-parallel-backend", self.data_parallel_backend, DATA_PARALLEL_BACKENDS)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        self.tool_options   # noqa: B018 - validates the pair (ValueError naming the flags)
        if self.data_parallel_backend != "ray":
            if self.data_parallel_size != 1:
                raise ValueError(f"--data-parallel-size={self.data_parallel_size} needs --data-parallel-backend ray "
                                 "(kv8 runs data-parallel replicas on Ray Serve only)")
            return
        if self.allowed_origins:
            raise ValueError("--allowed-origins is not supported with --data-parallel-backend ray (Serve's proxy "
                             "serves HTTP)")
        if self.request_header_timeout != REQUEST_HEADER_TIMEOUT_S:
            raise ValueError("--request-header-timeout is not supported with --data-parallel-backend ray (Serve's "
                             "proxy reads the headers)")

    @property
    def tool_options(self) -> ToolOptions:
        return ToolOptions(self.enable_auto_tool_choice, self.tool_call_parser)

    def resolved_api_key(self) -> str | None:
        """The API key: ``--api-key``, else ``$KV8_API_KEY``, else None (no key required)."""
        if self.api_key is not None:
            return self.api_key
        key = envs.api_key()
        if key is not None and not key.strip():
            raise ValueError(f"${envs.API_KEY_ENV} must not be blank (unset it to serve without a key)")
        return key

    def model_name(self, model: str) -> str:
        """The name clients use for the model ``model``: ``--served-model-name`` if given."""
        return self.served_model_name or model

    def resolved_ray_address(self) -> str | None:
        """The Ray cluster to join: ``--ray-address``, else ``$RAY_ADDRESS``; None = a new local cluster."""
        return self.ray_address or envs.ray_address()


def add_serve_args(parser: argparse.ArgumentParser, *model_flags: str, model_optional: bool = False) -> None:
    """The arguments of ``kv8 serve`` (alias ``kv8 run``) on ``parser``: the model (positional, and as ``model_flags``),
    the server and data-parallel options and the engine options. ``serve run``'s builder parses its arguments with
    the same set (:func:`kv8.entrypoints.dp.app.app_builder`)."""
    EngineArgs.add_model_arg(parser, *model_flags, optional=model_optional)
    ServerArgs.add_cli_args(parser, aliases=SERVER_FLAG_ALIASES)
    EngineArgs.add_cli_args(parser)
