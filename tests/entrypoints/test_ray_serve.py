"""Data-parallel replicas on Ray Serve (``kv8 serve --data-parallel-size 2 --data-parallel-backend ray``).

Fast tests: the routing policy (:class:`PrefixRouter`, pure Python), the routing text, the merged ``/metrics``
text and the flag checks. Slow tests: one real ``kv8 serve`` subprocess per module with 2 replicas on a new
local Ray cluster (loopback HTTP), driven by the ``openai`` client and ``httpx``. Oracles: the offline
:class:`LLM` on the same tiny model with one thread (each replica runs one), and the per-replica series of
``/metrics``. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from kv8 import LLM, SamplingParams
from kv8.entrypoints.dp.metrics import merge_replica_metrics
from kv8.entrypoints.dp.router import PrefixRouter, RouterConfig, chunk_hashes, routing_text
from tests.helpers.server import ENGINE_FLAGS, free_port, metrics, single_thread, terminate

API_KEY = "dp-key"
START_TIMEOUT_S = 150.0


# ---- the routing policy (no Ray) ----------------------------------------------------------------------------
def test_chunk_hashes_are_a_chain_of_full_chunks() -> None:
    a = chunk_hashes("x" * 10 + "y" * 10 + "z" * 5, 10)
    b = chunk_hashes("x" * 10 + "y" * 10 + "w" * 9, 10)
    assert len(a) == 2 and a == b                     # the partial tail is not remembered
    assert chunk_hashes("y" * 10 + "x" * 10, 10)[1] != a[1]   # a chunk's hash depends on what precedes it
    assert chunk_hashes("short", 10) == []


def test_router_prefers_the_replica_holding_the_prefix_within_the_imbalance() -> None:
    router = PrefixRouter(RouterConfig(chunk_chars=4, imbalance_threshold=2))
    first = router.choose("abcdefgh-one", {0: 0, 1: 0})
    assert (first.replica, first.reason) == (0, "least_loaded")
    # same 8-character prefix: replica 0 holds 2 chunks, and wins while its load is <= the other's + 2
    d = router.choose("abcdefgh-two", {0: 2, 1: 0})
    assert (d.replica, d.reason, d.matched_chunks) == (0, "prefix", 2)
    d = router.choose("abcdefgh-three", {0: 3, 1: 0})
    assert (d.replica, d.reason) == (1, "least_loaded")   # too loaded: the prefix is now on both
    assert router.matched_chunks("abcdefgh", 1) == 2
    d = router.choose("abcdefgh-four", {0: 0, 1: 1})      # both match 2 chunks (tail "-fou" too on none)
    assert (d.replica, d.reason) == (0, "prefix")


def test_router_spreads_distinct_prompts_and_forgets_a_dead_replica() -> None:
    router = PrefixRouter(RouterConfig(chunk_chars=4))
    picks = [router.choose(f"{i:04d} distinct", {0: 0, 1: 0, 2: 0}).replica for i in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]            # equal loads: the replica sent the fewest requests
    assert router.choose("0000 again", {0: 0, 1: 0, 2: 0}).replica == picks[0]
    router.forget(picks[0])
    assert router.matched_chunks("0000 distinct", picks[0]) == 0
    assert router.choose("only one", {2: 5}).replica == 2  # only the replicas that are up are candidates
    with pytest.raises(ValueError, match="no replica is up"):
        router.choose("x", {})


def test_router_table_is_bounded_lru() -> None:
    router = PrefixRouter(RouterConfig(chunk_chars=2, max_entries=3))
    router.choose("aabbcc", {0: 0})
    router.choose("ddee", {0: 0})
    assert len(router) == 3
    assert router.matched_chunks("ddee", 0) == 2 and router.matched_chunks("aabbcc", 0) == 0


def test_router_counts_only_the_leading_chunks_of_a_long_prompt() -> None:
    router = PrefixRouter(RouterConfig(chunk_chars=2, max_chunks=3))
    router.choose("aabbccdd", {0: 0, 1: 0})
    assert router.matched_chunks("aabbccxx", 0) == 3 and len(router) == 3


def test_router_config_is_validated() -> None:
    with pytest.raises(ValueError, match="chunk_chars=0 must be an int >= 1"):
        RouterConfig(chunk_chars=0)
    with pytest.raises(ValueError, match="imbalance_threshold"):
        RouterConfig(imbalance_threshold=-1)


def test_routing_text_of_completions_and_chats() -> None:
    assert routing_text("completions", {"prompt": "abc"}) == "abc"
    assert routing_text("completions", {"prompt": ["abc", "def"]}) == "abc"
    assert routing_text("completions", {"prompt": [1, 2, 3]}) == "1,2,3"
    assert routing_text("completions", {"prompt": [[1, 2], [3]]}) == "1,2"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    longer = chat + [{"role": "assistant", "content": "Hello"}]
    assert routing_text("chat", {"messages": longer}).startswith(routing_text("chat", {"messages": chat}))
    assert routing_text("tokenize", {"prompt": "abc"}) == ""
    # a Responses request routes as the chat it stands for: instructions as the system message, input's texts
    responses = {"instructions": "Be brief.", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                    "text": "Hi"}]}]}
    assert routing_text("responses", responses) == routing_text("chat", {"messages": chat})
    assert routing_text("responses", {"instructions": "Be brief.", "input": "Hi"}) == routing_text("chat",
                                                                                                  {"messages": chat})
    turn = {**responses, "input": [*responses["input"], {"type": "function_call", "call_id": "c", "name": "f",
                                                         "arguments": "{}"}]}
    assert routing_text("responses", turn).startswith(routing_text("chat", {"messages": chat}))


def test_merged_metrics_label_each_replica_and_sum_counters() -> None:
    one = ("# HELP kv8:prompt_tokens_total P.\n# TYPE kv8:prompt_tokens_total counter\nkv8:prompt_tokens_total 5\n"
           "# HELP kv8:kv_cache_usage_perc U.\n# TYPE kv8:kv_cache_usage_perc gauge\nkv8:kv_cache_usage_perc 0.5\n"
           "# HELP kv8:request_success_total S.\n# TYPE kv8:request_success_total counter\n"
           'kv8:request_success_total{finished_reason="stop"} 2\n')
    two = one.replace(" 5\n", " 7\n").replace("0.5", "0.25").replace(" 2\n", " 1.5\n")
    text = merge_replica_metrics({0: one, 1: two})
    lines = text.splitlines()
    assert lines.count("# TYPE kv8:prompt_tokens_total counter") == 1
    assert 'kv8:prompt_tokens_total{replica="0"} 5' in lines and 'kv8:prompt_tokens_total{replica="1"} 7' in lines
    assert 'kv8:prompt_tokens_total{replica="all"} 12' in lines
    assert 'kv8:request_success_total{replica="all",finished_reason="stop"} 3.5' in lines
    assert 'kv8:kv_cache_usage_perc{replica="1"} 0.25' in lines
    assert not any(line.startswith('kv8:kv_cache_usage_perc{replica="all"') for line in lines)   # a ratio
    # each family's samples follow its TYPE line
    starts = [i for i, line in enumerate(lines) if line.startswith("# TYPE")]
    assert all(lines[i + 1].startswith(lines[i].split()[2]) for i in starts)


def test_data_parallel_flag_errors(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kv8.entrypoints.cli import main

    base = ["serve", "--model", tiny_llama]
    assert main([*base, "--data-parallel-size", "2"]) == 2
    assert "--data-parallel-size=2 needs --data-parallel-backend ray" in capsys.readouterr().err
    assert main([*base, "-dp", "2", "-dpb", "ray", "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size=2 with --data-parallel-backend ray is not supported" in capsys.readouterr().err
    assert main([*base, "-dp", "0", "-dpb", "ray"]) == 2
    assert "--data-parallel-size=0 must be an int >= 1" in capsys.readouterr().err
    assert main([*base, "-dp", "0"]) == 2
    assert "--data-parallel-size=0 must be an int >= 1" in capsys.readouterr().err
    assert main([*base, "-dp", "2", "-dpb", "ray", "--allowed-origins", "*"]) == 2
    assert "--allowed-origins is not supported" in capsys.readouterr().err


def test_serve_run_builder_takes_kv8_serve_flags(tiny_llama: str) -> None:
    """``serve run kv8.entrypoints.dp.app:app_builder key=value``: values arrive as strings; no cluster is
    needed to build the application."""
    from ray.serve import Application

    from kv8.entrypoints.dp.app import app_builder

    app = app_builder({"model": tiny_llama, "data_parallel_size": "2", "enable_prefix_caching": "false",
                       "max_num_seqs": 8, "cpu_threads_per_rank": "1", "enable_auto_tool_choice": False})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="--tensor-parallel-size=2 with --data-parallel-backend ray"):
        app_builder({"model": tiny_llama, "tensor_parallel_size": 2})


def test_own_cluster_settings_keep_the_users_and_write_no_token() -> None:
    from kv8.entrypoints.dp.app import own_cluster_environment

    env: dict[str, str] = {}
    own_cluster_environment(env)
    assert env["RAY_memory_monitor_refresh_ms"] == "0" and env["RAY_AUTH_MODE"] == "token"
    assert len(env["RAY_AUTH_TOKEN"]) == 64
    other: dict[str, str] = {}
    own_cluster_environment(other)
    assert other["RAY_AUTH_TOKEN"] != env["RAY_AUTH_TOKEN"]            # a fresh token per cluster
    mine = {"RAY_memory_monitor_refresh_ms": "250", "RAY_AUTH_MODE": "disabled"}
    own_cluster_environment(mine)
    assert mine == {"RAY_memory_monitor_refresh_ms": "250", "RAY_AUTH_MODE": "disabled"}
    with_path = {"RAY_AUTH_TOKEN_PATH": "/run/secret"}
    own_cluster_environment(with_path)
    assert "RAY_AUTH_TOKEN" not in with_path and with_path["RAY_AUTH_MODE"] == "token"


class _FailingCall:
    """A replica call (the stream of ``KV8Replica.handle``) that raises ``error``; cancelling it raises too, as
    Ray's does for a call whose replica is gone."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __aiter__(self) -> _FailingCall:
        return self

    async def __anext__(self) -> Any:
        raise self.error

    def cancel(self) -> None:
        raise RuntimeError("the call's replica is gone")


class _Handle:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def options(self, **kw: Any) -> _Handle:
        return self

    def remote(self, *args: Any) -> _FailingCall:
        return _FailingCall(self.error)


def test_every_replica_failure_is_a_503_and_a_bug_in_the_replica_a_500() -> None:
    """Whatever Ray raises for a call (the actor died, Ray's memory monitor killed it, no answer at all, a
    cancel that raises too) is a 503 replica_failed and marks the replica down; only an exception kv8's own code
    raised inside the replica (RayTaskError) is a 500."""
    import asyncio

    from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

    from kv8.entrypoints.dp.ingress import IngressSpec, KV8Ingress
    from kv8.entrypoints.openai.protocol import APIError

    async def forward(error: BaseException) -> tuple[APIError, bool]:
        ingress = KV8Ingress(IngressSpec(1, "m", None), _Handle(error))
        ingress.ensure_prober = lambda: None   # type: ignore[method-assign]
        with pytest.raises(APIError) as info:
            await ingress.forward("completions", {"prompt": "x"})
        assert ingress.in_flight == {0: 0}
        return info.value, ingress.up[0]

    for error in (OutOfMemoryError("killed by the memory monitor"), RayActorError(), StopAsyncIteration(),
                  TimeoutError("no answer"), ConnectionError("reset")):
        err, up = asyncio.run(forward(error))
        assert (err.status, err.body()["error"]["code"], up) == (503, "replica_failed", False), error
    bug = RayTaskError("handle", "Traceback ...", ValueError("kv8 bug"))
    err, up = asyncio.run(forward(bug))
    assert err.status == 500 and up


# ---- 2 replicas on a local Ray cluster -------------------------------------------------------------------------
class DPServer:
    """``kv8 serve ... --data-parallel-size 2 --data-parallel-backend ray`` in a subprocess (its own session, so
    that teardown can reach every process it started)."""

    def __init__(self, model: str, log_path: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        args = ["serve", "--model", model, "--api-key", API_KEY, *ENGINE_FLAGS, "--data-parallel-size", "2",
                "--data-parallel-backend", "ray", "--cpu-threads-per-rank", "1", "--shutdown-timeout", "2",
                "--port", str(self.port)]
        full_env = {**os.environ, "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "kv8.entrypoints.cli", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "kv8: serving" not in self.read_log():
            assert self.proc.poll() is None, f"server exited early:\n{self.read_log()}"
            assert time.monotonic() < deadline, f"not serving after {START_TIMEOUT_S}s:\n{self.read_log()}"
            time.sleep(0.3)
        self.wait_all_up()

    def read_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def health(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/health", timeout=10)
        body: dict[str, Any] = r.json()
        return body

    def wait_all_up(self, timeout: float = 60.0, not_pid: int | None = None) -> dict[str, Any]:
        """Until /health reports every replica up with a known pid (none equal to ``not_pid``)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if all(r["up"] and r["pid"] not in (None, not_pid) for r in h["replicas"]):
                return h
            assert time.monotonic() < deadline, f"replicas not all up after {timeout}s: {h}\n{self.read_log()}"
            time.sleep(0.3)

    def stop(self) -> int:
        code = terminate(self.proc, timeout=60, kill=lambda: os.killpg(self.proc.pid, signal.SIGKILL))
        self.log.close()
        return code


@pytest.fixture(scope="module")
def dp_server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DPServer]:
    srv = DPServer(tiny_llama, str(tmp_path_factory.mktemp("dp") / "server.log"))
    pids = [r["pid"] for r in srv.health()["replicas"]]
    try:
        yield srv
    finally:
        pids += [r["pid"] for r in srv.health()["replicas"]] if srv.proc.poll() is None else []
        code = srv.stop()
        deadline = time.monotonic() + 30
        # nothing it started outlives it: the replica processes, and every process of its session (Ray's too)
        while left := [p for p in pids if _alive(p)] + _session_members(srv.proc.pid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(srv.proc.pid, signal.SIGKILL)
                pytest.fail(f"processes {left} outlived the server")
            time.sleep(0.2)
    assert code == 0, srv.read_log()
    assert "kv8: server stopped" in srv.read_log()


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"   # a zombie is gone


def _session_members(sid: int) -> list[int]:
    """Live processes whose session id is ``sid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _proc_stat(int(name))
            if stat is not None and stat[0] != "Z" and int(stat[3]) == sid:
                out.append(int(name))
    return out


@pytest.fixture(scope="module")
def dp_client(dp_server: DPServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=dp_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60.0)


def _per_replica(m: dict[str, float], name: str) -> list[float]:
    return [m.get(f'{name}{{replica="{r}"}}', 0.0) for r in (0, 1)]


def _wait_idle(server: DPServer, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (all(v == 0 for v in _per_replica(m, "kv8:kv_cache_usage_perc"))
                and all(v == 0 for v in _per_replica(m, "kv8:num_requests_in_flight"))
                and all(v == 0 for v in _per_replica(m, "kv8:dp_replica_requests_in_flight"))):
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout}s: {m}"
        time.sleep(0.1)


@pytest.mark.slow
def test_concurrent_streams_get_their_solo_greedy_text_over_both_replicas(
        dp_server: DPServer, dp_client: openai.OpenAI, tiny_llama: str) -> None:
    prompts = [f"{i} request: the quick brown fox" for i in range(16)]
    with single_thread():   # each replica runs one thread: the same kernels, the same float32 results
        llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=128, block_size=16, max_model_len=256, max_num_seqs=8)
        offline = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))]
    before = metrics(dp_server)
    solo = [dp_client.completions.create(model=tiny_llama, prompt=p, max_tokens=16, temperature=0.0).choices[0].text
            for p in prompts]
    assert solo == offline

    def stream_one(p: str) -> str:
        c = openai.OpenAI(base_url=dp_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)
        text = ""
        for chunk in c.completions.create(model=tiny_llama, prompt=p, max_tokens=16, temperature=0.0, stream=True):
            text += "".join(ch.text for ch in chunk.choices)
        return text

    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(stream_one, prompts))
    assert together == offline
    after = _wait_idle(dp_server)
    # distinct prompts are spread: each replica served some of them
    served = [a - b for a, b in zip(_per_replica(after, "kv8:prompt_tokens_total"),
                                    _per_replica(before, "kv8:prompt_tokens_total"))]
    assert all(s > 0 for s in served), served
    chat = dp_client.chat.completions.create(model=tiny_llama, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, temperature=0.0)
    assert chat.choices[0].message.content is not None
    # the Responses API through the ingress and a replica, streamed and not: the chat's answer
    kw = dict(model=tiny_llama, input="Hi", max_output_tokens=4, temperature=0.0)
    assert dp_client.responses.create(**kw).output_text == chat.choices[0].message.content
    events = list(dp_client.responses.create(stream=True, **kw))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == chat.choices[0].message.content
    models = dp_client.models.list()
    assert [m.id for m in models.data] == [tiny_llama]


@pytest.mark.slow
def test_shared_prefix_requests_land_on_one_replica(dp_server: DPServer, dp_client: openai.OpenAI,
                                                   tiny_llama: str) -> None:
    shared = ("Paris is the capital of France, and Berlin is the capital of Germany. London is the capital of "
              "England. Once upon a time there was a little model that stored its cache in eight bits. ")
    before = _wait_idle(dp_server)
    for i in range(6):
        dp_client.completions.create(model=tiny_llama, prompt=f"{shared}Question {i}?", max_tokens=2,
                                     temperature=0.0)
    after = _wait_idle(dp_server)
    hits = [a - b for a, b in zip(_per_replica(after, "kv8:prefix_cache_hits_total"),
                                  _per_replica(before, "kv8:prefix_cache_hits_total"))]
    prompts = [a - b for a, b in zip(_per_replica(after, "kv8:prompt_tokens_total"),
                                     _per_replica(before, "kv8:prompt_tokens_total"))]
    owner = max((0, 1), key=lambda r: prompts[r])
    assert prompts[1 - owner] == 0, prompts            # every request went to one replica ...
    assert hits[owner] >= 5 and hits[1 - owner] == 0, hits   # ... whose cache served the shared blocks
    routed = f'kv8:dp_requests_routed_total{{replica="{owner}",reason="prefix"}}'
    assert after.get(routed, 0) - before.get(routed, 0) == 5
    assert 'kv8:prefix_cache_hits_total{replica="all"}' in after


@pytest.mark.slow
def test_client_disconnect_aborts_on_the_replica(dp_server: DPServer, tiny_llama: str) -> None:
    """n=16 with max_num_seqs=8: the second wave of 8 sequences cannot start for 240 decode steps, longer than
    these clients wait before they go away, so at least 8 sequences of each request are aborted."""
    key = 'kv8:request_success_total{replica="all",finished_reason="abort"}'
    aborted = _wait_idle(dp_server).get(key, 0.0)
    body = dict(model=tiny_llama, prompt="Drop me", max_tokens=240, ignore_eos=True, temperature=0.0, n=16)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as c, c.stream("POST", dp_server.url + "/v1/completions",
                                                json=dict(body, stream=True), headers=auth) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
    deadline = time.monotonic() + 10
    while (m := metrics(dp_server)).get(key, 0.0) - aborted < 8:
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    aborted = _wait_idle(dp_server, timeout=10.0).get(key, 0.0)
    with pytest.raises(httpx.ReadTimeout):   # a non-streamed request whose client gives up
        httpx.post(dp_server.url + "/v1/completions", json=dict(body, prompt="Drop me too"), headers=auth,
                   timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 10
    while (m := metrics(dp_server)).get(key, 0.0) - aborted < 8:
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    _wait_idle(dp_server, timeout=10.0)


@pytest.mark.slow
def test_errors_keep_openai_shape(dp_server: DPServer, tiny_llama: str) -> None:
    url = dp_server.url + "/v1/completions"
    r = httpx.post(url, json={"model": tiny_llama, "prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url, json={"model": tiny_llama, "prompt": "x", "max_tokens": -1}, headers=auth, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url, json={"model": "other", "prompt": "x"}, headers=auth, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url, content=b"{", headers={**auth, "Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(dp_server.url + "/tokenize", json={"prompt": "Hello"}, headers=auth, timeout=10)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    r = httpx.get(dp_server.url + "/tokenizer_info", headers=auth, timeout=10)
    assert r.status_code == 200 and r.json()["eos_token"] == "</s>" and r.json()["chat_template"], r.text
    assert httpx.get(dp_server.url + "/tokenizer_info", timeout=10).status_code == 401
    stateful = {"model": tiny_llama, "input": "x", "previous_response_id": "r"}
    r = httpx.post(dp_server.url + "/v1/responses", json=stateful, headers=auth, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text


@pytest.mark.slow
def test_killed_replica_fails_its_requests_cleanly_and_comes_back(dp_server: DPServer, tiny_llama: str) -> None:
    """A stream and a non-streamed request on one replica (the second follows the first's prompt prefix); the
    replica's process is killed: both end with a 503 ``replica_failed`` within seconds, the endpoint serves on the
    other replica, and Ray's replacement rejoins."""
    health = dp_server.wait_all_up()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    prefix = "Kill me softly, " * 5   # longer than a routing chunk: the second request follows the first
    body = dict(model=tiny_llama, max_tokens=150, ignore_eos=True, temperature=0.0,
                n=16)   # two waves of 8 sequences: still running when the replica is killed

    def non_streamed() -> httpx.Response:
        return httpx.post(dp_server.url + "/v1/completions", headers=auth, timeout=30,
                          json=dict(body, prompt=prefix + "second"))

    def attempt() -> tuple[int, int, list[str], httpx.Response] | None:
        """Both requests in flight on one replica, then that replica killed: (victim, pid, the stream's remaining
        lines, the second's response); None when the first request finished before the replica had admitted the
        second (on a fast machine its two waves of 150 steps can end before the second's HTTP call reaches the
        replica: a miss of the set-up, not of what is tested), after both have finished."""
        with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as c, \
                c.stream("POST", dp_server.url + "/v1/completions",
                         json=dict(body, prompt=prefix + "first", stream=True), headers=auth) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            victim = _per_replica(metrics(dp_server), "kv8:dp_replica_requests_in_flight").index(1)
            second = pool.submit(non_streamed)
            # wait until the replica has admitted both (a call Serve has not delivered yet when the replica dies is
            # sent again to its replacement, and then succeeds)
            deadline = time.monotonic() + 30   # generous: a loaded machine (the suite beside other jobs) is slow
            while _per_replica(metrics(dp_server), "kv8:num_requests_in_flight")[victim] < 32:
                if second.done():
                    assert second.result().status_code == 200
                    assert [line for line in lines if line][-1] == "data: [DONE]"   # the first finished too
                    return None
                assert time.monotonic() < deadline, "the second request did not follow the prefix"
                time.sleep(0.02)
            pid = health["replicas"][victim]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line]
            assert time.monotonic() - killed < 20
            return victim, pid, rest, second.result(timeout=20)

    for _ in range(5):
        result = attempt()
        if result is not None:
            break
    assert result is not None, "in 5 attempts the first request always finished before the second was admitted"
    victim, pid, rest, answer = result
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error"
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "replica_failed"
    # the endpoint keeps serving, on the other replica
    for i in range(4):
        r = httpx.post(dp_server.url + "/v1/completions", headers=auth, timeout=30,
                       json=dict(model=tiny_llama, prompt=f"after {i}", max_tokens=2))
        assert r.status_code == 200, r.text
    h = dp_server.health()
    assert h["replicas"][1 - victim]["up"]   # (the victim may already be back: Ray restarts it meanwhile)
    # Ray restarts it and it rejoins
    dp_server.wait_all_up(timeout=90.0, not_pid=pid)
    m = metrics(dp_server)
    assert m[f'kv8:dp_replica_failures_total{{replica="{victim}"}}'] >= 1
    assert m[f'kv8:dp_replica_up{{replica="{victim}"}}'] == 1


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


@pytest.mark.slow
def test_kv8s_own_cluster_beside_a_cluster_already_on_the_host(tiny_llama: str, tmp_path: Any) -> None:
    """A Ray cluster started on the host (``ray start --head``) is not joined: without --ray-address kv8 starts its
    own (ray.init used to join that one, then refuse num_cpus). That cluster keeps its token in its processes'
    environment (no ~/.ray/auth_token), its raylet runs without Ray's memory monitor, and its session files lie
    in a directory only this user can enter."""
    head_home, kv8_home = tmp_path / "head_home", tmp_path / "kv8_home"
    head_home.mkdir()
    kv8_home.mkdir()
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--port", str(free_port()), "--num-cpus", "1",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            env={**os.environ, "HOME": str(head_home), "RAY_ADDRESS": ""}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    srv = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists("/tmp/ray/ray_current_cluster"):   # what ray.init would find and join
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.3)
        from kv8 import envs

        srv = DPServer(tiny_llama, str(tmp_path / "server.log"),
                       env={"HOME": str(kv8_home), "KV8_CACHE_DIR": envs.cache_dir()})   # the built kernels
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60.0)
        assert client.completions.create(model=tiny_llama, prompt="Hello", max_tokens=2).choices[0].text
        assert "a new local cluster" in srv.read_log()
        raylets = [p for p in _session_members(srv.proc.pid) if "raylet" in _cmdline(p).split()[0]]
        assert len(raylets) == 1, [_cmdline(p) for p in _session_members(srv.proc.pid)]
        env = _environ(raylets[0])
        assert env["RAY_memory_monitor_refresh_ms"] == "0" and env["RAY_AUTH_MODE"] == "token"
        assert len(env["RAY_AUTH_TOKEN"]) == 64 and not (kv8_home / ".ray" / "auth_token").exists()
        temp_dir = next(a.split("=", 1)[1] for a in _cmdline(raylets[0]).split() if a.startswith("--temp_dir="))
        private = os.path.dirname(temp_dir.rstrip("/"))
        assert os.path.basename(private).startswith("kv8-ray-") and os.stat(private).st_mode & 0o777 == 0o700
    finally:
        if srv is not None:
            assert srv.stop() == 0, srv.read_log()
            assert not os.path.exists(private)
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
