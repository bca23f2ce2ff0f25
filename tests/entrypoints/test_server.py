"""The OpenAI-compatible server, end to end: a real ``kv8 serve`` subprocess on a free loopback port, driven by
the official ``openai`` client and by raw ``httpx`` requests.

Oracles: the offline :class:`LLM` on the same tiny model and options (greedy text, prompt logprobs), and the
server itself (a request alone vs. the same request among 32 concurrent streams; streamed vs. non-streamed).
KV-cache state is read from ``/metrics``. Every wait is bounded.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from kv8 import LLM, SamplingParams
from tests.helpers.server import (
    API_KEY,
    ENGINE_FLAGS,
    SERVER_FLAGS,
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


@pytest.fixture(scope="module")
def server(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    # one intra-op thread: the tiny model gains nothing from two, and OpenMP barriers stall when the CPUs are busy
    srv = Server(["serve", "--model-id", tiny_llama, "--api-key", API_KEY, *ENGINE_FLAGS, *SERVER_FLAGS], log,
                 env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() == 0, srv.read_log()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60.0)


@pytest.fixture(scope="module")
def offline(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=128, block_size=16, max_model_len=256, max_num_seqs=8)


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


# ---- basic endpoints ----------------------------------------------------------------------------------------
def test_health_and_models(server: Server, client: openai.OpenAI, tiny_llama: str) -> None:
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_llama]


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


def test_chat_completion(client: openai.OpenAI, offline: LLM, tiny_llama: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is London?"}]
    with single_thread():
        ref = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, logprobs=2), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=tiny_llama, messages=messages, max_tokens=10, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    for item, tid, entry in zip(content, ref.outputs[0].token_ids, ref.outputs[0].logprobs):
        assert item.logprob == pytest.approx(entry[tid].logprob, abs=1e-5)
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)  # greedy
    stream = client.chat.completions.create(model=tiny_llama, messages=messages, max_tokens=10, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    text, reason, usage, roles = "", None, None, []
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
    assert roles == ["assistant"] and text == ref.outputs[0].text and reason == ref.outputs[0].finish_reason
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)
    # content given as a list of text parts is the same conversation
    parts = client.chat.completions.create(model=tiny_llama, max_tokens=10, temperature=0.0, messages=[
        messages[0], {"role": "user", "content": [{"type": "text", "text": "Where is "},
                                                  {"type": "text", "text": "London?"}]}])
    assert parts.choices[0].message.content == ref.outputs[0].text


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


TEXTS_BEYOND_ASCII = ["héllo wörld", "😀 emoji 🎉", "中文字符", "привет, мир", "naïve café — ok"]


def test_token_bytes_rebuild_the_text_byte_level_and_sentencepiece(tiny_llama: str) -> None:
    """Tokens holding part of a UTF-8 character give their real bytes (not U+FFFD's), for byte-level BPE (GPT-2's
    alphabet) and SentencePiece byte fallback (<0xE2>): joined, they are the text's UTF-8."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from kv8.entrypoints.openai.tokenizer import ServerTokenizer

    byte_level = ServerTokenizer(AutoTokenizer.from_pretrained(tiny_llama))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", *"abcdefghijklmnopqrstuvwxyz,.—", "\u2581o", "\u2581ok", "ll"]:
        vocab.setdefault(piece, len(vocab))
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "o"), ("\u2581o", "k"), ("l", "l")],
                              byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sentencepiece = ServerTokenizer(PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>",
                                                            unk_token="<unk>"))
    for tok, lead in ((byte_level, ""), (sentencepiece, " ")):
        for text in TEXTS_BEYOND_ASCII:
            ids = tok.encode(text, add_special_tokens=False)
            parts = tok.token_bytes(ids)
            assert b"".join(parts) == (lead + text).encode("utf-8"), (text, ids, parts)
            if len(text.encode()) > len(text):   # some token is part of a character: not U+FFFD's bytes
                assert all(p != "\ufffd".encode() for p in parts)
    assert sentencepiece.token_bytes([vocab["<0xE2>"], 1]) == [b"\xe2", b"<s>"]


def test_chat_logprobs_bytes_are_the_tokens_real_bytes(client: openai.OpenAI, tiny_llama: str) -> None:
    """An emoji, a CJK and a Cyrillic character generated one byte token at a time: each token's ``bytes`` is its
    byte (before: U+FFFD's EF BF BD), and joining them rebuilds the message."""
    from transformers import AutoTokenizer

    from kv8.entrypoints.openai.tokenizer import gpt2_byte_decoder

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    byte_token = {b: tok.convert_tokens_to_ids(ch) for ch, b in gpt2_byte_decoder().items()}
    for char in ("😀", "中", "ж"):
        raw = char.encode("utf-8")
        # decreasing biases and a repetition penalty of 2: byte i wins step i (biased 100 - 10 i, the bytes already
        # generated fall to about half), so greedy decoding spells the character byte by byte
        bias = {str(byte_token[b]): 100.0 - 10 * i for i, b in enumerate(raw)}
        resp = client.chat.completions.create(
            model=tiny_llama, messages=[{"role": "user", "content": "Say it"}], max_tokens=len(raw),
            temperature=0.0, logprobs=True, top_logprobs=2, logit_bias=bias, extra_body={"repetition_penalty": 2.0})
        choice = resp.choices[0]
        assert choice.message.content == char
        content = choice.logprobs.content
        assert [item.bytes for item in content] == [[b] for b in raw]
        assert b"".join(bytes(item.bytes) for item in content).decode("utf-8") == char
        # the alternatives carry their real bytes too (they rank the raw logits, before the bias)
        for alt in (t for item in content for t in item.top_logprobs):
            assert alt.bytes == list(alt.token.encode()) if "\ufffd" not in alt.token else len(alt.bytes) == 1


# ---- concurrency, disconnects, overload ---------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_bytes_join_to_the_content_when_the_answer_ends_with_eos(client: openai.OpenAI,
                                                                               tiny_llama: str, stream: bool) -> None:
    """An emoji spelled byte by byte, then EOS: the end token adds no text and has no logprobs entry (OpenAI's
    shape), so the entries' ``bytes`` join to exactly the content's UTF-8, streamed or not; usage still counts the
    end token (as vLLM does)."""
    from transformers import AutoTokenizer

    from kv8.entrypoints.openai.tokenizer import gpt2_byte_decoder

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    byte_token = {b: tok.convert_tokens_to_ids(ch) for ch, b in gpt2_byte_decoder().items()}
    raw = "😀".encode()
    bias = {str(byte_token[b]): 90.0 - 10 * i for i, b in enumerate(raw)}
    # EOS is in the prompt (the template's </s>), so the penalty halves it from the start: 100 -> 50, below every
    # byte's turn (90 .. 60) and above the bytes already spelled (45 .. 30)
    bias[str(tok.eos_token_id)] = 100.0
    for skip in (True, False):   # EOS's text is left out either way
        kw: dict[str, Any] = dict(model=tiny_llama, messages=[{"role": "user", "content": "Say it"}], max_tokens=8,
                                  temperature=0.0, logprobs=True, top_logprobs=1, logit_bias=bias,
                                  extra_body={"repetition_penalty": 2.0, "skip_special_tokens": skip})
        if stream:
            content, items, reason, usage = "", [], None, None
            for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                usage = chunk.usage or usage
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    items += ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
                    reason = ch.finish_reason or reason
        else:
            resp = client.chat.completions.create(**kw)
            content, items = resp.choices[0].message.content, resp.choices[0].logprobs.content
            reason, usage = resp.choices[0].finish_reason, resp.usage
        assert content == "😀" and reason == "stop"
        assert b"".join(bytes(item.bytes) for item in items) == content.encode("utf-8")
        assert len(items) == len(raw) and usage.completion_tokens == len(raw) + 1


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


# ---- bad input ----------------------------------------------------------------------------------------------
def test_client_metadata_is_accepted_and_changes_nothing(server: Server, client: openai.OpenAI,
                                                         tiny_llama: str) -> None:
    """Fields the openai SDK, LangChain and LiteLLM send by default are accepted and ignored; the developer role
    renders as system; response_format text is a no-op while an unusable JSON schema is refused."""
    plain = dict(model=tiny_llama, temperature=0.0, max_tokens=4)
    meta = dict(user="u-1", store=False, metadata={"k": "v"}, safety_identifier="s-1", prompt_cache_key="p-1")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    base = client.chat.completions.create(messages=msgs, **plain).choices[0].message.content
    dev_msgs = [{"role": "developer", "content": "Be brief.", "name": "ops"},
                {"role": "user", "content": "Hello there", "name": "ann"}]
    got = client.chat.completions.create(messages=dev_msgs, modalities=["text"], parallel_tool_calls=False,
                                         response_format={"type": "text"}, **meta, **plain)
    assert got.choices[0].message.content == base
    cmpl = client.completions.create(prompt="Hello there", user="u-1", extra_body={"store": False}, **plain)
    assert cmpl.choices[0].text == client.completions.create(prompt="Hello there", **plain).choices[0].text
    chat = "/v1/chat/completions"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    expect_error(post(server, chat, {**plain, "messages": msgs, "response_format": bad_schema}),
                 400, "response_format", param="response_format")
    expect_error(post(server, chat, {**plain, "messages": msgs, "modalities": ["audio"]}), 400, "modalities",
                 param="modalities")


def test_tokenize_and_detokenize_endpoints(server: Server, tiny_llama: str) -> None:
    """vLLM's /tokenize and /detokenize: the ids generation sees for a prompt or a chat, and text back."""
    from kv8.loader.tokenizer import load_tokenizer

    oracle = load_tokenizer("hf", tiny_llama)
    resp = post(server, "/tokenize", {"model": tiny_llama, "prompt": "Hello there"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == oracle.encode("Hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256
    plain = post(server, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False}).json()["tokens"]
    assert plain == oracle.encode("Hello there", add_special_tokens=False)
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    assert chat == list(oracle.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"])
    back = post(server, "/detokenize", {"model": tiny_llama, "tokens": plain})
    assert back.status_code == 200 and back.json()["prompt"] == oracle.decode(plain)
    expect_error(post(server, "/detokenize", {"tokens": [0, 999999]}), 400, "vocabulary", param="tokens")
    expect_error(post(server, "/tokenize", {"prompt": "a", "messages": msgs}), 400, "exactly one")
    expect_error(post(server, "/tokenize", {"prompt": "a", "model": "other"}), 404, "does not exist")
    expect_error(post(server, "/tokenize", {"prompt": "a"}, key=None), 401, "API key")


def test_tokenizer_info_serves_lm_eval_remote_tokenizer(server: Server, tiny_llama: str) -> None:
    """vLLM's GET /tokenizer_info, used the way lm-evaluation-harness's ``tokenizer_backend=remote`` uses it: the
    special tokens' text, whose /tokenize (no special tokens added) gives their ids, and the chat template, which
    its own jinja renders to the text the model's tokenizer makes; behind the API key like every other route."""
    import jinja2
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(tiny_llama)
    assert httpx.get(server.url + "/tokenizer_info", timeout=10).status_code == 401
    resp = httpx.get(server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["tokenizer_class"] == type(oracle).__name__
    assert (info["eos_token"], info["bos_token"]) == (oracle.eos_token, oracle.bos_token)
    assert "vocab_file" not in info and "merges_file" not in info
    eos_ids = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos_ids == [oracle.eos_token_id]
    msgs = [{"role": "user", "content": "Hello there"}]
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(messages=msgs,
                                                                              add_generation_prompt=True)
    assert rendered == oracle.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


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


def test_metrics_exposition(server: Server, client: openai.OpenAI, tiny_llama: str) -> None:
    before = wait_idle(server)
    for _ in range(2):  # 40 prompt tokens = 2 full blocks: the second request hits the prefix cache
        r = client.completions.create(model=tiny_llama, prompt=list(range(10, 50)), max_tokens=4, temperature=0.0)
    after = metrics(server)
    assert after["kv8:generation_tokens_total"] - before["kv8:generation_tokens_total"] == 2 * r.usage.completion_tokens
    assert after["kv8:prompt_tokens_total"] - before["kv8:prompt_tokens_total"] == 80
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name, kind in [("kv8:kv_cache_usage_perc", "gauge"), ("kv8:num_requests_running", "gauge"),
                       ("kv8:num_requests_waiting", "gauge"), ("kv8:prefix_cache_hit_rate", "gauge"),
                       ("kv8:generation_tokens_total", "counter"), ("kv8:time_to_first_token_seconds", "histogram"),
                       ("kv8:time_per_output_token_seconds", "histogram")]:
        assert f"# TYPE {name} {kind}" in text
    m = metrics(server)
    assert m["kv8:time_to_first_token_seconds_count"] >= 1
    assert m['kv8:time_to_first_token_seconds_bucket{le="+Inf"}'] == m["kv8:time_to_first_token_seconds_count"]
    assert m["kv8:time_per_output_token_seconds_count"] >= 1
    assert 0.0 < m["kv8:prefix_cache_hit_rate"] <= 1.0
    assert re.search(r"^kv8:kv_cache_total_blocks 128$", text, re.M)


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


# ---- the real model, and shutdown ---------------------------------------------------------------------------
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


def test_output_mailbox_keeps_latest_and_errors() -> None:
    import asyncio

    from kv8.engine.async_engine import OutputMailbox

    async def scenario() -> list[Any]:
        box = OutputMailbox()
        box.put_nowait(("a", "a1"))  # type: ignore[arg-type]
        box.put_nowait(("a", "a2"))  # type: ignore[arg-type]
        box.put_nowait(("b", "b1"))  # type: ignore[arg-type]
        first = await box.get_all()
        err = RuntimeError("down")
        box.put_nowait(("a", err))
        box.put_nowait(("a", "a3"))  # type: ignore[arg-type]  # an error is never replaced
        second = await box.get_all()
        waiting = asyncio.ensure_future(box.get_all())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing new: get_all waits
        waiting.cancel()
        return [first, second]

    first, second = asyncio.run(scenario())
    assert first == [("a", "a2"), ("b", "b1")]
    assert len(second) == 1 and isinstance(second[0][1], RuntimeError)


def test_histogram_exposition() -> None:
    from kv8.entrypoints.openai.metrics import Histogram

    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.render()[2:] == ['x_seconds_bucket{le="0.1"} 2', 'x_seconds_bucket{le="1.0"} 3',
                              'x_seconds_bucket{le="+Inf"} 4', "x_seconds_sum 3.65", "x_seconds_count 4"]
    with pytest.raises(ValueError, match="strictly ascending"):
        Histogram("y", "help", (1.0, 0.5))


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
