"""The server's life cycle and its app: SIGTERM drains then aborts after the shutdown timeout (the tiny Llama's
``server`` fixture of tests/entrypoints/conftest.py; the real SmolLM2, slow), the command line's defaults and bad
flags, CORS for ``--allowed-origins``, and the routes ``kv8 serve``'s app and the data-parallel ingress register.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.server import Server, drop, open_stream


def test_sigterm_drains_then_aborts_after_the_shutdown_timeout(server: Server, tiny_llama: str) -> None:
    """Streams of 16 + 16 + 8 sequences need 5 waves x 240 decode steps, far more than the 0.3 s shutdown
    timeout: after SIGTERM the stream still running at the timeout ends with an error event and [DONE], and the
    process exits 0 (new requests during the drain: tests/entrypoints/test_server_faults.py)."""
    body = dict(model=tiny_llama, prompt="Once upon", max_tokens=240, ignore_eos=True, n=16, stream=True)
    streams = [open_stream(server, dict(body, n=n)) for n in (16, 16, 8)]
    try:
        server.proc.send_signal(signal.SIGTERM)
        tails = [[line for line in lines if line.startswith("data: ")][-2:] for _, _, lines in streams]
    finally:
        drop(streams)
    assert all(tail[-1] == "data: [DONE]" for tail in tails)
    err = json.loads(tails[-1][0][6:])["error"]
    assert "shutdown timeout" in err["message"] and err["code"] == "engine_unavailable"
    assert server.proc.wait(timeout=30) == 0, server.read_log()
    assert "server stopped" in server.read_log() and "Traceback" not in server.read_log()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)


# Greedy SmolLM2 with an FP8 cache at scale 1.0 answers this with a margin of > 1 nat at every token; "What is
# the capital of France?" starts with a tie ("The" / "L", equal bf16 logits with AMX) that rounding decides.
CAPITAL_QUESTION = "Name the capital city of France."


@pytest.mark.slow
def test_smollm2_greedy_chat_and_sigterm_exits_0(tmp_path: Any) -> None:
    srv = Server(["run", "smollm2-135m", "--kv-cache-dtype", "fp8", "--max-model-len", "512",
                  "--kv-cache-memory", "64MiB"], str(tmp_path / "smollm2.log"), env={"KV8_API_KEY": "k"})
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0, timeout=120.0)
        resp = c.chat.completions.create(model="smollm2-135m", temperature=0.0, max_tokens=8, messages=[
            {"role": "user", "content": CAPITAL_QUESTION}])
        assert "Paris" in resp.choices[0].message.content
        # SIGTERM while a request streams: it is finished (or aborted) and the process exits 0
        stream = c.chat.completions.create(model="smollm2-135m", temperature=0.0, max_tokens=6, stream=True,
                                           messages=[{"role": "user", "content": "Count to ten."}])
        chunks = iter(stream)
        next(chunks)
        srv.proc.send_signal(signal.SIGTERM)
        reasons = [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason]
        assert reasons == ["length"]
        assert srv.proc.wait(timeout=30) == 0, srv.read_log()
        assert "server stopped" in srv.read_log()
    finally:
        srv.stop()


def test_cli_defaults_and_bad_flags(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kv8.entrypoints.cli import build_parser, main

    parser = build_parser()
    run = parser.parse_args(["run", "m", "--kv-cache-dtype", "fp8", "--quantization-param-path", "s.json"])
    assert (run.model, run.host, run.port, run.kv_cache_dtype, run.quantization_param_path) == \
        ("m", "127.0.0.1", 8000, "fp8", "s.json")
    for flag in ("--model-id", "--model"):
        serve = parser.parse_args(["serve", flag, "x", "--kv-cache-dtype", "fp8_e5m2"])
        assert (serve.model, serve.host, serve.kv_cache_dtype) == ("x", "127.0.0.1", "fp8_e5m2")
    # option errors are reported before any weights are loaded
    assert main(["serve", "--model-id", tiny_llama, "--max-n", "0"]) == 2
    assert "--max-n=0 must be an int >= 1" in capsys.readouterr().err
    assert main(["serve", "--model-id", tiny_llama, "--api-key", " "]) == 2
    assert "--api-key must not be empty" in capsys.readouterr().err


def test_allowed_origins_turn_cors_on_for_those_origins_only(tiny_llama: str) -> None:
    """``--allowed-origins`` adds CORS for the named origins; others get no Access-Control-Allow-Origin."""
    import asyncio

    from kv8.engine.args import EngineArgs
    from kv8.engine.async_engine import AsyncEngine
    from kv8.engine.engine import LLMEngine
    from kv8.entrypoints.openai.api_server import build_app
    from kv8.entrypoints.openai.cli_args import ServerArgs
    from kv8.entrypoints.openai.serving import ServingLimits

    engine = LLMEngine(EngineArgs(model=tiny_llama, dtype="float32", num_kv_blocks=16, max_model_len=64))
    limits = ServingLimits(served_model_name="tiny", max_model_len=64, max_tokens=64, max_n=2, max_in_flight=4,
                           kv_capacity_tokens=16 * 16, kv_block_size=16)
    app = build_app(AsyncEngine(engine), limits, ServerArgs(allowed_origins=("http://localhost:3000",)))

    async def preflight(origin: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kv8") as c:
            return await c.options("/v1/completions", headers={"Origin": origin,
                                                               "Access-Control-Request-Method": "POST"})

    allowed = asyncio.run(preflight("http://localhost:3000"))
    assert allowed.headers.get("access-control-allow-origin") == "http://localhost:3000"
    other = asyncio.run(preflight("http://evil.example"))
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("tokenizer_info", [True, False])
def test_server_and_ingress_serve_the_same_routes(tiny_llama: str, tokenizer_info: bool) -> None:
    """kv8 serve's app and the data-parallel ingress register their engine routes from one table, so they offer
    the same methods and paths; --no-enable-tokenizer-info-endpoint takes /tokenizer_info off both (a 404)."""
    import asyncio

    from fastapi.routing import APIRoute

    from kv8.engine.args import EngineArgs
    from kv8.engine.async_engine import AsyncEngine
    from kv8.engine.engine import LLMEngine
    from kv8.entrypoints.dp.ingress import IngressSpec, KV8Ingress, build_ingress_app
    from kv8.entrypoints.openai.api_server import build_app
    from kv8.entrypoints.openai.cli_args import ServerArgs
    from kv8.entrypoints.openai.serving import ServingLimits

    engine = LLMEngine(EngineArgs(model=tiny_llama, dtype="float32", num_kv_blocks=16, max_model_len=64))
    limits = ServingLimits(served_model_name="tiny", max_model_len=64, max_tokens=64, max_n=2, max_in_flight=4,
                           kv_capacity_tokens=16 * 16, kv_block_size=16)
    args = ServerArgs(enable_tokenizer_info_endpoint=tokenizer_info)

    class Handle:   # a replica handle that is never called
        def options(self, **_: Any) -> Handle:
            return self

    apps = [build_app(AsyncEngine(engine), limits, args),
            build_ingress_app(KV8Ingress(IngressSpec(1, "tiny", None, args), Handle()))]

    def routes(app: Any) -> set[tuple[str, str]]:
        return {(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}

    assert routes(apps[0]) == routes(apps[1])
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
            ("POST", "/detokenize"), ("GET", "/v1/models")} <= routes(apps[0])
    assert (("GET", "/tokenizer_info") in routes(apps[0])) is tokenizer_info

    async def get(app: Any) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kv8") as c:
            return await c.get("/tokenizer_info")

    if not tokenizer_info:
        for app in apps:
            r = asyncio.run(get(app))
            assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /tokenizer_info"
