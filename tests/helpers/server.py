"""The server harness: a real ``kv8`` server subprocess on a free loopback port, its flags in the tests, and what
the tests send it and read back (requests, streams, errors, /metrics)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import httpx
import torch

#: the key the test servers require (``--api-key``)
API_KEY = "test-key-123"
# --no-adaptive-cpu-threads: the server keeps its threads whatever else the test machine runs (tests compare its
# float32 answers with the offline engine's bit for bit; see conftest._engines_keep_their_threads)
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "16", "--max-model-len", "256",
                "--max-num-seqs", "8", "--no-adaptive-cpu-threads"]
#: the server's limits in the tests: small, so that overload and request-size checks are quick to reach
SERVER_FLAGS = ["--max-waiting-requests", "32", "--max-n", "16", "--max-request-bytes", "65536",
                "--shutdown-timeout", "0.3"]
#: how long a :class:`Server` may take to answer /health
START_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, timeout: float, kill: Callable[[], None] | None = None) -> int:
    """SIGTERM ``proc`` (if it runs), wait ``timeout`` seconds for it, then ``kill()`` (default: SIGKILL to it) and
    wait again; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            (kill or proc.kill)()
            proc.wait(timeout=10)
    return proc.returncode


class Server:
    """``kv8 <args>`` in a subprocess; ``launcher`` replaces ``-m kv8.entrypoints.cli`` (e.g. ``-c CODE`` that
    patches something, then calls ``kv8.entrypoints.cli.main(sys.argv[1:])``)."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        launch = launcher or ["-m", "kv8.entrypoints.cli"]
        self.proc = subprocess.Popen([sys.executable, *launch, *args, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"server exited early:\n{self.read_log()}"
            assert time.monotonic() < deadline, f"server not healthy after {START_TIMEOUT_S}s:\n{self.read_log()}"
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def read_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self) -> int:
        code = terminate(self.proc, timeout=30)
        self.log.close()
        return code


class Served(Protocol):
    """A server the tests started: ``url`` is its base address (http://127.0.0.1:PORT)."""

    url: str


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the offline oracle with one intra-op thread, like the test server (OMP_NUM_THREADS=1), so both use
    the same kernels and float32 results match bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def metrics(server: Served) -> dict[str, float]:
    """The samples of the server's /metrics, by series name (labels included)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(server: Server, timeout: float = 20.0) -> dict[str, float]:
    """Until the server runs, queues and holds nothing (its /metrics), at most ``timeout`` s; its metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["kv8:kv_cache_usage_perc"] == 0.0 and m["kv8:num_requests_running"] == 0
                and m["kv8:num_requests_waiting"] == 0 and m["kv8:num_requests_in_flight"] == 0):
            return m
        assert time.monotonic() < deadline, f"server still busy after {timeout}s: {m}"
        time.sleep(0.1)


def post(server: Server, path: str, body: Any, key: str | None = API_KEY, raw: bytes | None = None) -> httpx.Response:
    """POST ``body`` as JSON (or the bytes ``raw``) to the server's ``path``, with ``key`` as the bearer token."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def open_stream(server: Server, body: dict[str, Any]) -> tuple[httpx.Client, Any, Iterator[str]]:
    """A streamed /v1/completions left open (its client, response context and lines): :func:`drop` closes it."""
    c = httpx.Client(timeout=60)
    cm = c.stream("POST", server.url + "/v1/completions", json=body,
                  headers={"Authorization": f"Bearer {API_KEY}"})
    resp = cm.__enter__()
    assert resp.status_code == 200, resp.read()
    lines = resp.iter_lines()
    return c, cm, lines


def drop(streams: list[tuple[httpx.Client, Any, Iterator[str]]]) -> None:
    """Close streams from :func:`open_stream` without reading them: the client disconnects."""
    for c, cm, _ in streams:
        cm.__exit__(None, None, None)
        c.close()


def expect_error(resp: httpx.Response, status: int, *fragments: str, param: str | None = None) -> None:
    """``resp`` is an OpenAI-shaped error of ``status`` whose message holds ``fragments`` (and names ``param``)."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for f in fragments:
        assert f in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err


def with_surrogate(body: Any, path: str = "") -> Iterator[tuple[Any, str]]:
    """Copies of a JSON value with one key or one string replaced by a lone surrogate, each with the path a 400
    names (a key's surrogate escaped as text)."""
    if isinstance(body, dict):
        for key, item in body.items():
            where = f"{path}.{key}" if path else key
            bad_key = key + "\udc00"
            yield {bad_key if k == key else k: v for k, v in body.items()}, where + "\\udc00"
            for inner, inner_where in with_surrogate(item, where):
                yield {**body, key: inner}, inner_where
    elif isinstance(body, list):
        for i, item in enumerate(body):
            for inner, inner_where in with_surrogate(item, f"{path}[{i}]"):
                yield [*body[:i], inner, *body[i + 1:]], inner_where
    elif isinstance(body, str):
        yield "\ud800" + body, path
