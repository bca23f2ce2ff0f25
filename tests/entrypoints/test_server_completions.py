"""``/v1/completions`` of a real ``kv8 serve`` (the ``server`` fixture of tests/entrypoints/conftest.py), driven by
the official ``openai`` client and by raw ``httpx`` requests: greedy text, logprobs, echo scoring, stop strings,
seeds, the stream's shape (chat's too), penalties and logit bias; 32 concurrent streams, disconnects and overload;
and the OpenAI errors bad requests get on every route.

Oracles: the offline :class:`LLM` on the same tiny model and options (greedy text, prompt logprobs), and the
server itself (a request alone vs. the same request among 32 concurrent streams; streamed vs. non-streamed).
KV-cache state is read from ``/metrics``. Every wait is bounded.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from kv8 import LLM, SamplingParams
from tests.helpers.server import (
    API_KEY,
    Server,
    drop,
    expect_error,
    metrics,
    open_stream,
    post,
    single_thread,
    wait_idle,
    with_surrogate,
)


def _collect_completion_stream(stream: Any) -> tuple[dict[int, str], dict[int, str | None], Any]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason is not None:
                reasons[ch.index] = ch.finish_reason
    return texts, reasons, usage


def test_greedy_completion_matches_offline_engine(server: Server, client: openai.OpenAI, offline: LLM,
                                                  tiny_llama: str) -> None:
    prompts = ["London is the capital of", "Once upon a time there"]
    with single_thread():
        ref = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    resp = client.completions.create(model=tiny_llama, prompt=prompts, max_tokens=12, temperature=0.0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]
    assert [c.finish_reason for c in resp.choices] == [r.outputs[0].finish_reason for r in ref]
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert resp.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)
    # streaming gives the same text; token-id prompts give the same as the text they encode
    texts, reasons, usage = _collect_completion_stream(client.completions.create(
        model=tiny_llama, prompt=prompts[0], max_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True}))
    assert texts[0] == ref[0].outputs[0].text and reasons[0] == ref[0].outputs[0].finish_reason
    assert usage.completion_tokens == len(ref[0].outputs[0].token_ids)
    by_ids = client.completions.create(model=tiny_llama, prompt=ref[1].prompt_token_ids, max_tokens=12,
                                       temperature=0.0)
    assert by_ids.choices[0].text == ref[1].outputs[0].text


def test_completion_logprobs(client: openai.OpenAI, offline: LLM, tiny_llama: str) -> None:
    resp = client.completions.create(model=tiny_llama, prompt="Paris is the capital of", max_tokens=6,
                                     temperature=0.0, logprobs=3)
    lp = resp.choices[0].logprobs
    with single_thread():
        ref = offline.generate("Paris is the capital of", SamplingParams(temperature=0.0, max_tokens=6, logprobs=3),
                               use_tqdm=False)[0].outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.token_ids) == 6
    for i, (tid, entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[tid].logprob, abs=1e-5)
        # the legacy format keys alternatives by their text, so ids that decode alike (e.g. to U+FFFD) merge
        assert set(lp.top_logprobs[i]) == {v.decoded_token for v in entry.values()}
        # greedy: the chosen token is the most likely one
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_scoring_like_lm_eval(client: openai.OpenAI, offline: LLM, tiny_llama: str) -> None:
    """lm-evaluation-harness local-completions: echo=true, max_tokens=0, logprobs=1 scores the prompt."""
    tok = offline.get_tokenizer()
    contexts = ["The quick brown fox jumps over the lazy dog.", "Numbers: 0 1 2 3"]
    ids = [tok.encode(c) for c in contexts]
    resp = client.completions.create(model=tiny_llama, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                     temperature=0.0)
    with single_thread():
        ref = offline.generate([{"prompt_token_ids": x} for x in ids],
                               SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert resp.usage.completion_tokens == 0
    for choice, r, x in zip(resp.choices, ref, ids):
        lp = choice.logprobs
        assert choice.text == tok.decode(x)
        assert len(lp.tokens) == len(x) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(x)):
            assert lp.token_logprobs[i] == pytest.approx(r.prompt_logprobs[i][x[i]].logprob, abs=1e-5)
            assert set(lp.top_logprobs[i]) == {v.decoded_token for v in r.prompt_logprobs[i].values()}
    # a string prompt echoes the prompt itself, and with max_tokens > 0 the completion follows it
    both = client.completions.create(model=tiny_llama, prompt=contexts[0], max_tokens=4, echo=True, logprobs=0,
                                     temperature=0.0)
    alone = client.completions.create(model=tiny_llama, prompt=contexts[0], max_tokens=4, temperature=0.0)
    assert both.choices[0].text == contexts[0] + alone.choices[0].text
    assert len(both.choices[0].logprobs.tokens) == len(ids[0]) + both.usage.completion_tokens


def test_stop_strings_streamed_and_not(client: openai.OpenAI, tiny_llama: str) -> None:
    prompt = "Berlin is the capital of"
    full = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=24, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    clean = [i for i in range(4, len(full) - 3) if "\ufffd" not in full[i:i + 3]]
    assert clean, f"no usable stop string in {full!r}"
    stop = full[clean[len(clean) // 2]:clean[len(clean) // 2] + 3]
    expected = full[:full.find(stop)]
    kwargs: dict[str, Any] = dict(model=tiny_llama, prompt=prompt, max_tokens=24, temperature=0.0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    resp = client.completions.create(**kwargs)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    texts, reasons, _ = _collect_completion_stream(client.completions.create(stream=True, **kwargs))
    assert texts[0] == expected and reasons[0] == "stop"


def test_n_and_seed_reproducible(client: openai.OpenAI, tiny_llama: str) -> None:
    kwargs: dict[str, Any] = dict(model=tiny_llama, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                                  n=3)
    a = client.completions.create(seed=1234, **kwargs)
    b = client.completions.create(seed=1234, **kwargs)
    c = client.completions.create(seed=4321, **kwargs)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len({ch.text for ch in a.choices}) > 1  # the n samples differ from each other
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    texts, reasons, _ = _collect_completion_stream(client.completions.create(seed=1234, stream=True, **kwargs))
    assert [texts[i] for i in range(3)] == [ch.text for ch in a.choices] and len(reasons) == 3


def _sse_chunks(server: Server, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + route, json=body,
                                                 headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks_have_openai_shape(server: Server, tiny_llama: str, route: str, n: int,
                                         include_usage: bool) -> None:
    """OpenAI's stream shape, which clients reading ``choices[0]`` of each chunk (LangChain, LiteLLM) rely on: one
    choice per chunk; each choice's finish reason in its last chunk, once; with include_usage every chunk has
    ``usage: null`` and a last chunk holds ``choices: []`` and the usage; a chat choice opens with the role."""
    body: dict[str, Any] = dict(model=tiny_llama, max_tokens=6, temperature=1.0, seed=5, n=n, stream=True,
                                ignore_eos=True)
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Where is London?"}]
    else:
        body["prompt"] = "Once upon a time"
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    chunks = _sse_chunks(server, route, body)
    if include_usage:
        assert all(chunk["usage"] is None for chunk in chunks[:-1])
        last = chunks.pop()
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6 * n, last
    else:
        assert all("usage" not in chunk for chunk in chunks)
    assert all(len(chunk["choices"]) == 1 for chunk in chunks), [c["choices"] for c in chunks]
    by_index: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk["choices"][0]["index"], []).append(chunk["choices"][0])
    assert sorted(by_index) == list(range(n))
    for choices in by_index.values():
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
        if "delta" in choices[0]:
            assert choices[0]["delta"]["role"] == "assistant"


def test_penalties_and_logit_bias_match_offline_engine(client: openai.OpenAI, offline: LLM, tiny_llama: str) -> None:
    """presence/frequency/repetition penalties and logit_bias through the openai client, completions and chat,
    against the offline engine with the same SamplingParams; and they do change the greedy text."""
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    options = [dict(presence_penalty=1.5), dict(frequency_penalty=2.0), dict(repetition_penalty=1.8),
               dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.2)]
    with single_thread():
        plain = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
        refs = [offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, **o), use_tqdm=False)[0]
                for o in options]
    for o, ref in zip(options, refs):
        extra = {k: v for k, v in o.items() if k == "repetition_penalty"}   # vLLM's extension: not an SDK argument
        std = {k: v for k, v in o.items() if k != "repetition_penalty"}
        resp = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=24, temperature=0.0,
                                         extra_body=extra, **std)
        assert resp.choices[0].text == ref.outputs[0].text, o
    assert any(r.outputs[0].token_ids != plain.outputs[0].token_ids for r in refs)
    # logit_bias: +100 on one token makes greedy decoding repeat it; -100 on the greedy token removes it
    target = 42
    forced = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=5, temperature=0.0,
                                       logit_bias={str(target): 100}, logprobs=0)
    with single_thread():
        ref = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, logit_bias={target: 100.0}),
                               use_tqdm=False)[0].outputs[0]
    assert ref.token_ids == [target] * 5 and forced.choices[0].text == ref.text
    first = plain.outputs[0].token_ids[0]
    with single_thread():
        ref = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, logit_bias={first: -100.0}),
                               use_tqdm=False)[0].outputs[0]
    banned = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=4, temperature=0.0,
                                       logit_bias={str(first): -100})
    assert ref.token_ids[0] != first and banned.choices[0].text == ref.text
    # chat: the same options reach the engine
    messages = [{"role": "user", "content": "Where is London? Where is London?"}]
    with single_thread():
        chat_ref = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=1.0,
                                                         repetition_penalty=1.3, logit_bias={7: 3.0}),
                                use_tqdm=False)[0]
    chat = client.chat.completions.create(model=tiny_llama, messages=messages, max_tokens=12, temperature=0.0,
                                          frequency_penalty=1.0, logit_bias={"7": 3.0},
                                          extra_body={"repetition_penalty": 1.3})
    assert chat.choices[0].message.content == chat_ref.outputs[0].text


def test_32_concurrent_streams_match_alone_then_cache_empty(server: Server, client: openai.OpenAI,
                                                           tiny_llama: str) -> None:
    prompts = [f"Request {i}: the quick brown fox" for i in range(32)]
    alone = [client.completions.create(model=tiny_llama, prompt=p, max_tokens=16, temperature=0.0).choices[0].text
             for p in prompts]

    def stream_one(p: str) -> str:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)
        texts, reasons, _ = _collect_completion_stream(
            c.completions.create(model=tiny_llama, prompt=p, max_tokens=16, temperature=0.0, stream=True))
        assert set(reasons) == {0}
        return texts[0]

    with ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(stream_one, prompts))
    assert together == alone
    wait_idle(server)


def test_disconnects_free_blocks_and_overload_is_503(server: Server, tiny_llama: str) -> None:
    """max_num_seqs=8, so streams of n=16 are waves of 8 sequences x 240 decode steps: whatever is queued behind
    32 sequences cannot start for 960 steps (over a second here), far longer than these clients wait before
    dropping. The abort counter tells aborted sequences from finished ones."""
    abort_key = 'kv8:request_success_total{finished_reason="abort"}'
    long_body = dict(model=tiny_llama, prompt="Paris is the capital", max_tokens=240, temperature=0.0,
                     ignore_eos=True, stream=True, n=16)
    aborted = wait_idle(server).get(abort_key, 0.0)
    streams = []
    try:
        streams += [open_stream(server, long_body) for _ in range(2)]  # 32 sequences; the limit is 8 + 32 = 40
        over = post(server, "/v1/completions", dict(model=tiny_llama, prompt="x y", max_tokens=2, n=9))
        assert over.status_code == 503 and over.json()["error"]["code"] == "overloaded"
        # exactly at the limit: admitted, queued behind the streams; its non-streaming client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(60, read=0.2),
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json=dict(model=tiny_llama, prompt="a b c", max_tokens=2, n=8))
        deadline = time.monotonic() + 10
        while (m := metrics(server)).get(abort_key, 0.0) - aborted < 8:
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        assert m[abort_key] - aborted == 8
    finally:
        drop(streams)
    aborted = wait_idle(server, timeout=10.0)[abort_key]
    # streaming clients that drop mid-stream: 16 + 16 + 8 = 40 sequences (at the limit), dropped after one chunk
    streams = []
    try:
        streams += [open_stream(server, dict(long_body, n=n)) for n in (16, 16, 8)]
        first = next(line for line in streams[0][2] if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        assert metrics(server)["kv8:kv_cache_usage_perc"] > 0
    finally:
        drop(streams)
    m = wait_idle(server, timeout=10.0)
    assert 8 <= m[abort_key] - aborted <= 40


def test_bad_requests_get_openai_errors_and_server_keeps_serving(server: Server, client: openai.OpenAI,
                                                                 tiny_llama: str) -> None:
    ok = dict(model=tiny_llama, prompt="Hello there", max_tokens=2, temperature=0.0)
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    expect_error(post(server, cmpl, None, raw=b'{"model": "x", "prompt": '), 400, "not valid JSON")
    expect_error(post(server, cmpl, None, raw=b'{"model": "\xff\xfe", "prompt": "a"}'), 400, "UTF-8")
    expect_error(post(server, cmpl, None, raw=b""), 400, "empty")
    # only JSON bodies: a form or text/plain POST (which browsers send without a CORS preflight) is a 415
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Authorization": f"Bearer {API_KEY}", **({"Content-Type": ctype} if ctype else {})}
        resp = httpx.post(server.url + cmpl, content=json.dumps(ok).encode(), headers=headers, timeout=60)
        assert resp.status_code == 415 and "application/json" in resp.json()["error"]["message"], resp.text
    # CORS is off by default: a preflight gets no Access-Control-Allow-Origin
    pre = httpx.options(server.url + cmpl, headers={"Origin": "http://evil.example", "Access-Control-Request-Method":
                                                   "POST"}, timeout=60)
    assert "access-control-allow-origin" not in pre.headers
    # lone UTF-16 surrogates are valid JSON escapes but not characters: 400 naming where, never a 500
    def raw(body: Any) -> bytes:
        return json.dumps(body).encode()   # ensure_ascii: a lone surrogate is written as its \\u escape

    expect_error(post(server, cmpl, None, raw=raw({**ok, "prompt": "a\ud800b"})), 400, "surrogate",
                 param="prompt")
    expect_error(post(server, cmpl, None, raw=raw({**ok, "prompt": ["ok", "\udfff"]})), 400, "surrogate",
                 param="prompt[1]")
    expect_error(post(server, cmpl, None, raw=raw({**ok, "model": "\ud800"})), 400, "surrogate", param="model")
    expect_error(post(server, chat, None, raw=raw({"model": tiny_llama, "max_tokens": 2, "messages": [
        {"role": "user", "content": "\ud83d"}]})), 400, "surrogate", param="messages[0].content")
    # ... in object keys too, at any depth, on every route that reads a JSON body: every key and every string of
    # valid bodies replaced in turn (tools: test_tool_calling). The path names the key with its surrogate escaped
    # (the error itself must be encodable).
    bodies = [(cmpl, {**ok, "logit_bias": {"5": 1}, "stream": True, "stream_options": {"include_usage": True}}),
              (chat, {"model": tiny_llama, "max_tokens": 2, "messages": [
                  {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "ann"}]}),
              ("/tokenize", {"model": tiny_llama, "prompt": "a"}), ("/detokenize", {"tokens": [1, 2]})]
    for route, body in bodies:
        assert post(server, route, body).status_code == 200, (route, body)
        for bad, where in with_surrogate(body):
            expect_error(post(server, route, None, raw=raw(bad)), 400, "surrogate", param=where)
    expect_error(post(server, cmpl, [1, 2]), 400, "JSON object")
    expect_error(post(server, cmpl, None, raw=json.dumps(ok).replace("0.0", "NaN").encode()), 400, "NaN")
    # wrong types (strict: no coercion)
    expect_error(post(server, cmpl, {**ok, "temperature": "0.5"}), 400, "temperature", param="temperature")
    expect_error(post(server, cmpl, {**ok, "max_tokens": True}), 400, "max_tokens", param="max_tokens")
    expect_error(post(server, cmpl, {**ok, "prompt": 5}), 400, "prompt", param="prompt")
    expect_error(post(server, cmpl, {**ok, "stream": "yes"}), 400, "stream", param="stream")
    # out-of-range values and server limits
    expect_error(post(server, cmpl, {**ok, "temperature": 3}), 400, "temperature", param="temperature")
    expect_error(post(server, cmpl, {**ok, "top_p": 0}), 400, "top_p", param="top_p")
    expect_error(post(server, cmpl, {**ok, "n": 0}), 400, "n", param="n")
    expect_error(post(server, cmpl, {**ok, "n": 17}), 400, "limit of 16", param="n")
    # more sequences than can ever be in flight (8 running + 32 waiting): 400 with the limit, not 503 "retry"
    expect_error(post(server, cmpl, {**ok, "prompt": ["Hello"] * 41}), 400, "41 sequences", "limit of 40",
                 param="prompt")
    expect_error(post(server, cmpl, {**ok, "prompt": ["a", "b", "c"], "n": 16}), 400, "48 sequences")
    expect_error(post(server, cmpl, {**ok, "logprobs": 21}), 400, "logprobs", param="logprobs")
    expect_error(post(server, cmpl, {**ok, "max_tokens": -1}), 400, "max_tokens", param="max_tokens")
    expect_error(post(server, cmpl, {**ok, "max_tokens": 100000}), 400, "limit of 256", param="max_tokens")
    expect_error(post(server, cmpl, {**ok, "max_tokens": 0}), 400, "echo", param="max_tokens")
    expect_error(post(server, cmpl, {**ok, "top_k": -2}), 400, "top_k", param="top_k")
    expect_error(post(server, cmpl, {**ok, "stop": [""]}), 400, "empty")
    expect_error(post(server, cmpl, {**ok, "stream_options": {"include_usage": True}}), 400, "stream")
    expect_error(post(server, cmpl, {**ok, "prompt": [0, 1, 999999]}), 400, "vocabulary", param="prompt")
    # unknown or unsupported fields are refused, never ignored
    expect_error(post(server, cmpl, {**ok, "foo": 1}), 400, "'foo'", param="foo")
    # penalties and logit_bias out of range: 400 naming the field
    expect_error(post(server, cmpl, {**ok, "presence_penalty": 2.5}), 400, "presence_penalty",
                 param="presence_penalty")
    expect_error(post(server, cmpl, {**ok, "frequency_penalty": -3}), 400, "frequency_penalty",
                 param="frequency_penalty")
    expect_error(post(server, cmpl, {**ok, "repetition_penalty": 0}), 400, "repetition_penalty",
                 param="repetition_penalty")
    expect_error(post(server, cmpl, {**ok, "logit_bias": {"1": 101}}), 400, "[-100, 100]", param="logit_bias")
    expect_error(post(server, cmpl, {**ok, "logit_bias": {"x": 1}}), 400, "token ids", param="logit_bias")
    expect_error(post(server, cmpl, {**ok, "logit_bias": {"999999": 1}}), 400, "vocabulary", param="logit_bias")
    expect_error(post(server, chat, {"model": tiny_llama, "messages": [{"role": "user", "content": "hi"}],
                                     "logit_bias": {"1": "5"}}), 400, "logit_bias", param="logit_bias")
    # empty and huge prompts
    expect_error(post(server, cmpl, {**ok, "prompt": ""}), 400, "empty", param="prompt")
    expect_error(post(server, cmpl, {**ok, "prompt": []}), 400, "empty")
    expect_error(post(server, cmpl, {**ok, "prompt": ["a", ""]}), 400, "prompt[1] is empty")
    long_ids = [5] * 300
    r = post(server, cmpl, {**ok, "prompt": long_ids})
    expect_error(r, 400, "300 tokens", "256", "KV cache holds 2048 tokens", param="prompt")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    expect_error(post(server, cmpl, {**ok, "prompt": [5] * 250, "max_tokens": 10}), 400, "260",
                 param="max_tokens")
    expect_error(post(server, cmpl, {**ok, "prompt": "word " * 20000}), 413, "limit of 65536")
    # chat-specific
    expect_error(post(server, chat, {"model": tiny_llama, "messages": []}), 400, "messages", param="messages")
    expect_error(post(server, chat, {"model": tiny_llama, "messages": [{"role": "robot", "content": "hi"}]}),
                 400, "role", param="messages")
    expect_error(post(server, chat, {"model": tiny_llama, "messages": [{"role": "user", "content": "hi"}],
                                     "top_logprobs": 2}), 400, "requires logprobs")
    expect_error(post(server, chat, {"model": tiny_llama, "messages": [{"role": "user", "content": "hi"}],
                                     "tools": []}), 400, "tools", "at least 1", param="tools")
    # auth, model, route
    expect_error(post(server, cmpl, ok, key="wrong"), 401, "API key")
    expect_error(post(server, cmpl, ok, key=None), 401, "API key")
    expect_error(httpx.get(server.url + "/v1/models", timeout=10), 401, "API key")
    expect_error(post(server, cmpl, {**ok, "model": "gpt-4"}), 404, "gpt-4", param="model")
    expect_error(post(server, "/v1/embeddings", ok), 404, "no route")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=tiny_llama, prompt="hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    # still serving, and nothing leaked
    assert post(server, cmpl, ok).status_code == 200
    m = wait_idle(server)
    assert m['kv8:request_rejected_total{status="400"}'] >= 30
