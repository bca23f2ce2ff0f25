"""``/v1/chat/completions`` of a real ``kv8 serve`` (the ``server`` fixture of tests/entrypoints/conftest.py) through
the official ``openai`` client: greedy text and logprobs against the offline :class:`LLM`, streamed and not; the
logprobs' ``bytes`` of tokens that hold part of a character; the fields clients send by default.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kv8 import LLM, SamplingParams
from tests.helpers.server import Server, expect_error, post, single_thread


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


NON_TEXT_PARTS = [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "input_audio"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
]


@pytest.mark.parametrize("part,kind", NON_TEXT_PARTS)
def test_a_non_text_content_part_is_a_400_saying_the_model_is_text_only(server: Server, client: openai.OpenAI,
                                                                         tiny_llama: str, part: dict[str, Any],
                                                                         kind: str) -> None:
    """Issue 42, item 5: an image, audio or file part gets a 400 that says the server serves a text-only model and
    which part type it refused, with ``param`` pointing at the part (not pydantic's union problems); on chat
    completions and /tokenize. Text parts are served."""
    text = {"type": "text", "text": "Hello there"}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [text, part]}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=tiny_llama, messages=msgs, max_tokens=2)   # type: ignore[arg-type]
    error = info.value.body
    assert isinstance(error, dict)
    assert error["message"].startswith(f"this server serves a text-only model: content part type {kind!r} is not "
                                       "supported"), error
    assert error["param"] == info.value.param == "messages.1.content.1"
    assert "problems in all" not in error["message"] and "valid string" not in error["message"]
    expect_error(post(server, "/tokenize", {"messages": [{"role": "user", "content": [part]}]}), 400,
                 f"text-only model: content part type {kind!r}", param="messages.0.content.0")
    ok = client.chat.completions.create(model=tiny_llama, messages=[msgs[0], {"role": "user", "content": [text]}],
                                        max_tokens=2)
    assert ok.choices[0].finish_reason is not None
