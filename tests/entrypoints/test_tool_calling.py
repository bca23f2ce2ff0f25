"""OpenAI tool calling in /v1/chat/completions (:mod:`kv8.entrypoints.openai.tool_calling`).

Oracles: transformers' ``apply_chat_template`` on the same OpenAI-shaped history (arguments as dicts) and the
literal blocks the fixture template (``tests/fixtures/tool_chat_template.jinja``) writes; ``jsonschema`` for
constrained arguments; the openai SDK's own stream accumulator (``ChatCompletionStreamState``) for streamed
deltas, against the non-streamed answer of the same greedy / seeded request. A tiny random Llama is given the
fixture template (tools supported) or keeps the tiny models' plain one (no tool support).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import ValidationError

from kv8.engine.args import EngineArgs
from kv8.engine.async_engine import AsyncEngine
from kv8.engine.engine import LLMEngine
from kv8.entrypoints.cli import main as cli_main
from kv8.entrypoints.openai.metrics import ServerMetrics
from kv8.entrypoints.openai.protocol import APIError, ChatCompletionRequest, validation_error
from kv8.entrypoints.openai.request_run import Stream
from kv8.entrypoints.openai.serving import OpenAIServing, ServingLimits
from kv8.entrypoints.openai.tokenizer import ServerTokenizer
from kv8.entrypoints.openai.tool_calling import (
    HermesParser,
    NamedCallParser,
    ParsedCall,
    RequiredCallsParser,
    ToolCallStream,
    ToolOptions,
    ToolPlan,
    required_schema,
)
from kv8.loader.tokenizer import load_tokenizer
from kv8.outputs import CompletionOutput, RequestOutput
from tests.helpers.paths import FIXTURES
from tests.helpers.server import API_KEY, SERVER_FLAGS, Server, expect_error, post, with_surrogate
from tests.helpers.tiny_models import CALL_PIECES, make_calling_model, make_tiny_model

FIXTURE_TEMPLATE = FIXTURES / "tool_chat_template.jinja"
FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "16", "--max-model-len", "1024",
         "--max-num-seqs", "8", "--no-adaptive-cpu-threads"]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
HISTORY = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Paris and the time?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
               {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]


# ---- models, servings, server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama with the tiny models' chat template (no tool support); context 2048 for tool prompts."""
    return make_tiny_model(str(tmp_path_factory.mktemp("plain")), "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def tool_model(plain_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same weights with the fixture's tool-capable template."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tool"))
    shutil.copytree(plain_model, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    with open(FIXTURE_TEMPLATE) as f:
        tok.chat_template = f.read()
    tok.save_pretrained(path)
    return path


def _serving(model: str, options: ToolOptions | None = None) -> OpenAIServing:
    """An OpenAIServing whose engine thread is not started: enough to validate, render and plan requests."""
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", num_kv_blocks=64, max_model_len=1024,
                                  max_num_seqs=2))
    limits = ServingLimits(served_model_name="m", max_model_len=1024, max_tokens=1024, max_n=4, max_in_flight=8,
                           kv_capacity_tokens=64 * 16, kv_block_size=16)
    return OpenAIServing(AsyncEngine(engine), limits, ServerMetrics(), tool_options=options)


@pytest.fixture(scope="module")
def tool_serving(tool_model: str) -> OpenAIServing:
    return _serving(tool_model)


@pytest.fixture(scope="module")
def server(tool_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("tool_server") / "server.log")
    srv = Server(["serve", "--model-id", tool_model, "--api-key", API_KEY, *FLAGS, *SERVER_FLAGS,
                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], log, env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() == 0, srv.read_log()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)


def _request(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **body})


def _refused(body: dict[str, Any]) -> APIError:
    """The 400 a request body gets at validation."""
    with pytest.raises(ValidationError) as info:
        _request(**body)
    err = validation_error(info.value)
    assert err.status == 400
    return err


def _check_calls(message: Any, names: set[str]) -> None:
    """Every call has a distinct call_ id, a known name and arguments (a JSON string) matching its schema."""
    ids = [c.id for c in message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[Any, Any]:
    """The streamed answer accumulated by the openai SDK's own state machine, and the usage chunk."""
    state = ChatCompletionStreamState()
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            state.handle_chunk(chunk)
    return state.current_completion_snapshot, usage   # get_final_completion refuses finish_reason length


def _same_answer(streamed: Any, plain: Any) -> None:
    """Choice by choice: content (exactly: None is not ""), calls (name, arguments), finish reason."""
    assert len(streamed.choices) == len(plain.choices)
    for s, p in zip(sorted(streamed.choices, key=lambda c: c.index), plain.choices):
        assert s.message.content == p.message.content
        assert [(c.function.name, c.function.arguments) for c in s.message.tool_calls or []] == \
               [(c.function.name, c.function.arguments) for c in p.message.tool_calls or []]
        assert s.finish_reason == p.finish_reason


# ---- parsers (no model) ------------------------------------------------------------------------------------------
NAMES = frozenset({"get_weather", "get_time"})


def test_hermes_parser_cases() -> None:
    parser = HermesParser(NAMES)

    def parse(text: str) -> tuple[str, list[tuple[str, Any]]]:
        out = parser.parse(text, final=True)
        return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls]

    one = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    assert parse(one) == ("Let me look.", [("get_weather", {"city": "Paris", "days": 2})])
    two = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>\n')
    assert parse(two) == ("", [("get_time", {}), ("get_weather", {"city": "Oslo", "days": 1})])
    malformed = 'A <tool_call>{"name": "get_time", "arguments": {</tool_call> B'
    assert parse(malformed) == (malformed, [])
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse(unknown) == (unknown, [])
    not_object = '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>'
    assert parse(not_object) == (not_object, [])
    nested = ('<tool_call>{"name": "get_weather", "arguments": {"city": "{x}", "days": 3, '
              '"extra": {"a": [{"b": "}"}]}}}</tool_call>')
    assert parse(nested) == ("", [("get_weather", {"city": "{x}", "days": 3, "extra": {"a": [{"b": "}"}]}})])
    uni = 'Voilà 🌤 <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京", "days": 1}}</tool_call>'
    content, calls = parse(uni)
    assert content == "Voilà 🌤" and calls == [("get_weather", {"city": "Zürich 東京", "days": 1})]
    assert "Zürich 東京" in parser.parse(uni, final=True).calls[0].arguments   # not \\u-escaped
    # an unterminated block at the end: a call when its JSON is whole, content otherwise
    assert parse('<tool_call>{"name": "get_time", "arguments": {}}') == ("", [("get_time", {})])
    assert parse('ok <tool_call>{"name": "get_ti') == ('ok <tool_call>{"name": "get_ti', [])
    # no calls: the text is the content as it is, whitespace included
    assert parse("  plain text\n") == ("  plain text\n", [])
    # parallel_tool_calls false: only the first call; the next block stays text
    single = HermesParser(NAMES, max_calls=1).parse(two, final=True)
    assert [c.name for c in single.calls] == ["get_time"]
    assert single.content == "\n" + two.splitlines()[1]


def test_required_and_named_parsers() -> None:
    text = '[{"name":"get_weather","parameters":{"city":"a}b\\"","days":2}},{"name":"get_time","parameters":{}}]'
    out = RequiredCallsParser().parse(text, final=True)
    assert out == type(out)("", (ParsedCall("get_weather", '{"city":"a}b\\"","days":2}'),
                                 ParsedCall("get_time", "{}")))
    # cut by max_tokens: the arguments so far are kept; an element whose name is not complete is dropped
    cut = RequiredCallsParser().parse('[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"ci',
                                      final=True)
    assert cut.calls == (ParsedCall("get_time", "{}"), ParsedCall("get_weather", '{"ci'))
    assert RequiredCallsParser().parse('[{"name":"get_wea', final=True).calls == ()
    assert NamedCallParser("get_time").parse("{}", final=True).calls == (ParsedCall("get_time", "{}"),)
    schema = required_schema([_request(messages=[{"role": "user", "content": "x"}], tools=TOOLS).tools[0]],
                             parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}


STREAM_CASES = [
    (ToolPlan("auto", None, HermesParser(NAMES)),
     'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done <tool_c'),
    (ToolPlan("auto", None, HermesParser(NAMES)), '\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'),
    (ToolPlan("auto", None, HermesParser(NAMES)), '<tool_call>{"name": "nope"}</tool_call> <tool_call>{"name":'),
    (ToolPlan("auto", None, HermesParser(NAMES)), "<tool_ca plain text, no calls <"),
    (ToolPlan("required", None, RequiredCallsParser()),
     '[{"name":"get_weather","parameters":{"city":"[}{","days":7}},{"name":"get_time","parameters":{}}]'),
    (ToolPlan("named", None, NamedCallParser("get_weather")), '{"city":"Oslo","days":1,"unit":"C"}'),
]


@pytest.mark.parametrize("plan,text", STREAM_CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_rebuild_the_final_message(plan: ToolPlan, text: str, step: int) -> None:
    """The invariant streaming relies on: parsing every prefix and sending the differences gives, accumulated by the
    openai SDK, the non-streamed message (content, calls, finish reason)."""
    assert plan.parser is not None
    stream = ToolCallStream()
    state = ChatCompletionStreamState()
    base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    first = None if plan.mode in ("required", "named") else ""
    state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": first}}]}))
    cuts = list(range(step, len(text), step)) + [len(text)]
    for end in cuts:
        final = end == len(text)
        parsed = plan.parser.parse(text[:end], final=final)
        content, calls = stream.step(parsed)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        reason = plan.finish_reason(parsed, "stop") if final else None
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}))
    got = state.get_final_completion().choices[0]
    message, reason = plan.message(text, "stop")
    assert got.finish_reason == reason
    assert (got.message.content or None) == message["content"]
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == \
           [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]


# ---- rendering and refusals (in process) ------------------------------------------------------------------------
def test_history_renders_through_the_template(tool_serving: OpenAIServing, tool_model: str) -> None:
    """Assistant tool calls and tool replies reach the template as transformers expects them (arguments as
    dicts), with the tools; token ids equal transformers' own rendering."""
    from transformers import AutoTokenizer

    req = _request(messages=HISTORY, tools=TOOLS, tool_choice="required")
    ids = tool_serving._chat_sub(req).prompt_ids
    oracle = AutoTokenizer.from_pretrained(tool_model)
    history = json.loads(json.dumps(HISTORY))
    for call in history[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = oracle.apply_chat_template(history, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    assert ids == list(expected["input_ids"])
    text = oracle.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text and "<tool_response>\n12:00\n" in text
    assert '{"name": "get_time", "description": "The time now"}' in text          # the tools, in the system turn
    assert text.endswith("<|im_start|>assistant\n")
    # /tokenize renders the same prompt
    tokenized = tool_serving.tokenize(_tokenize_request(HISTORY, TOOLS))
    assert tokenized["tokens"] == ids


def _tokenize_request(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Any:
    from kv8.entrypoints.openai.protocol import TokenizeRequest

    return TokenizeRequest.model_validate({"messages": messages, "tools": tools})


def test_a_template_without_tool_support_is_a_400(plain_model: str) -> None:
    serving = _serving(plain_model, ToolOptions(True, "hermes"))
    user = [{"role": "user", "content": "hi"}]
    for body, param, fragment in [
        (dict(messages=user, tools=TOOLS, tool_choice="required"), "tools", "does not read `tools`"),
        (dict(messages=user, tools=TOOLS, tool_choice="none"), "tools", "does not read `tools`"),
        (dict(messages=HISTORY), "messages", "messages[2] is an assistant message with tool_calls"),
        (dict(messages=[*HISTORY[:2], {"role": "assistant", "content": "ok", "tool_calls": HISTORY[2]["tool_calls"]}]),
         "messages", "messages[2]"),
    ]:
        with pytest.raises(APIError) as info:
            serving._chat_sub(_request(**body))
        assert info.value.status == 400 and info.value.param == param
        assert "chat template has no tool support" in info.value.message and fragment in info.value.message
    # plain chats are rendered as before
    assert serving._chat_sub(_request(messages=user)).prompt_ids == serving.tokenizer.chat_ids(
        _request(messages=user).messages)


def test_bad_tool_requests_are_400s_naming_the_field(tool_serving: OpenAIServing) -> None:
    user = [{"role": "user", "content": "hi"}]
    named = {"type": "function", "function": {"name": "get_forecast"}}
    cases: list[tuple[dict[str, Any], str, str]] = [
        (dict(messages=user, tools=TOOLS, tool_choice=named), "tool_choice", "'get_forecast', which is not in tools"),
        (dict(messages=user, tool_choice="required"), "tool_choice", "requires tools"),
        (dict(messages=user, tool_choice=named), "tool_choice", "requires tools"),
        (dict(messages=user, tools=[]), "tools", "at least 1"),
        (dict(messages=user, tools=[TOOLS[0], TOOLS[0]]), "tools", "'get_weather'"),
        (dict(messages=user, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
         "tools", "type 'object'"),
        (dict(messages=user, tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools", "pattern"),
        (dict(messages=user, tools=[{"type": "retrieval"}]), "tools", "function"),
        (dict(messages=user, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "response_format", "cannot be combined with tools"),
        (dict(messages=user, tools=TOOLS, tool_choice="sometimes"), "tool_choice", "tool_choice"),
        (dict(messages=[{"role": "assistant", "content": None}]), "messages", "needs content or tool_calls"),
        (dict(messages=[{"role": "user", "content": None}]), "messages", "needs content"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages", "needs tool_call_id"),
        (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), "messages", "only tool messages"),
        (dict(messages=[{"role": "user", "content": "x", "tool_calls": HISTORY[2]["tool_calls"]}]), "messages",
         "only assistant messages"),
        (dict(messages=[*user, {"role": "assistant", "tool_calls": []}]), "messages", "empty list"),
        (dict(messages=[*user, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]), "messages",
         "no earlier assistant message called"),
        (dict(messages=[*user, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
         "messages", "not valid JSON"),
        (dict(messages=[*user, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
         "messages", "must be a JSON object"),
        (dict(messages=[*user, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": NaN}'}}]}]),
         "messages", "NaN is not valid JSON"),
        (dict(messages=[*user, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]),
         "messages", "string"),
        (dict(messages=[*user, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}]), "messages", "distinct"),
    ]
    for body, param, fragment in cases:
        err = _refused(body)
        assert err.param == param, (body, err.message)
        assert fragment in err.message, (body, err.message)
    # checks that need the server: tool_choice auto without --enable-auto-tool-choice (the default with tools), and
    # schemas that do not compile
    for choice in ("auto", None):
        with pytest.raises(APIError) as info:
            tool_serving._chat_sub(_request(messages=user, tools=TOOLS, tool_choice=choice))
        assert info.value.param == "tool_choice" and "--enable-auto-tool-choice" in info.value.message
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "foo"}}}}}]
    with pytest.raises(APIError) as info:
        tool_serving._chat_sub(_request(messages=user, tools=broken, tool_choice="none"))
    assert info.value.param == "tools" and "tools[0].function.parameters of 'f' is not a usable JSON schema" in \
        info.value.message
    # tool_choice none without tools is allowed (a no-op), and parallel_tool_calls alone too
    assert tool_serving._chat_sub(_request(messages=user, tool_choice="none", parallel_tool_calls=False)).prompt_ids


def test_tool_flags_are_checked_and_list_the_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser (allowed: hermes)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--tool-call-parser", "mistral"])
    assert info.value.code == 2
    assert "invalid choice: 'mistral'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="allowed: hermes"):
        ToolOptions(True, "pythonic")


# ---- end to end (kv8 serve, openai client) -----------------------------------------------------------------------
def test_required_and_named_calls_match_their_schemas(client: openai.OpenAI, server: Server, tool_model: str) -> None:
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=tool_model, messages=msgs, tools=TOOLS, max_tokens=300)
    got = client.chat.completions.create(tool_choice="required", n=3, temperature=1.0, seed=5, **kw)
    for choice in got.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) >= 1
        _check_calls(choice.message, {"get_weather", "get_time"})
    single = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0,
                                            seed=6, **kw)
    for choice in single.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check_calls(choice.message, {"get_weather", "get_time"})
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           n=2, temperature=1.0, seed=7, **kw)
    for choice in named.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None   # OpenAI's reason for a forced call
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        _check_calls(choice.message, {"get_weather"})
    # usage: the prompt as /tokenize renders it (messages + tools), and every generated token
    prompt = post(server, "/tokenize", {"messages": msgs, "tools": TOOLS}).json()["count"]
    assert named.usage.prompt_tokens == prompt
    assert named.usage.total_tokens == prompt + named.usage.completion_tokens > prompt
    # cut by max_tokens: finish_reason length, the arguments generated so far
    cut = client.chat.completions.create(**{**kw, "max_tokens": 3}, tool_choice="required", temperature=0.0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto",
                                    "none"])
def test_streamed_tool_calls_equal_the_non_streamed_answer(client: openai.OpenAI, tool_model: str,
                                                           choice: Any) -> None:
    kw = dict(model=tool_model, messages=HISTORY + [{"role": "user", "content": "And Oslo?"}], tools=TOOLS,
              tool_choice=choice, max_tokens=120, n=2, temperature=1.0, seed=11)
    plain = client.chat.completions.create(**kw)
    streamed, usage = _stream(client, **kw)
    _same_answer(streamed, plain)
    assert usage is not None and usage.model_dump() == plain.usage.model_dump()
    if choice in ("auto", "none"):   # the random model writes no <tool_call>: its text is the content
        assert all(not c.message.tool_calls and c.finish_reason in ("stop", "length") for c in plain.choices)
    else:
        assert all(c.message.tool_calls for c in plain.choices)
        ids = [c.id for ch in streamed.choices for c in ch.message.tool_calls]
        assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


def test_auto_content_is_the_text_the_parser_leaves(client: openai.OpenAI, tool_model: str) -> None:
    """auto decodes freely (as vLLM does): its content is the text tool_choice none gets for the same seed (both
    with special tokens kept, as the parser reads them)."""
    kw = dict(model=tool_model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=40,
              temperature=1.0, seed=3)
    auto = client.chat.completions.create(tool_choice="auto", **kw)
    none = client.chat.completions.create(tool_choice="none", extra_body={"skip_special_tokens": False}, **kw)
    text = none.choices[0].message.content
    message, reason = ToolPlan("auto", None, HermesParser(NAMES)).message(text, none.choices[0].finish_reason)
    assert auto.choices[0].message.content == message["content"]
    assert auto.choices[0].finish_reason == reason
    assert auto.usage == none.usage


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama that answers every chat with one hermes call and then EOS (:func:`make_calling_model`)."""
    return make_calling_model(str(tmp_path_factory.mktemp("calling")))


def test_a_tool_call_answer_has_no_content_and_no_end_token_text(calling_model: str, tmp_path: Path) -> None:
    """auto mode keeps special tokens for the parser; the EOS that ends the answer must still add no text, so a
    reply that is one call has ``content: null`` (streamed: no content), as vLLM answers (issue 33, item 1)."""
    srv = Server(["serve", "--model-id", calling_model, "--api-key", API_KEY, *FLAGS, *SERVER_FLAGS,
                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], str(tmp_path / "server.log"),
                 env={"OMP_NUM_THREADS": "1"})
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)
        kw = dict(model=calling_model, messages=[{"role": "user", "content": "What time is it?"}], tools=TOOLS,
                  max_tokens=16, temperature=0.0)
        plain = client.chat.completions.create(**kw)
        choice = plain.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_time", "{}")]
        assert plain.usage.completion_tokens == len(CALL_PIECES) + 1     # the EOS is counted, not shown
        streamed, _ = _stream(client, **kw)
        _same_answer(streamed, plain)
        # tool_choice none: the same text is the content, still without the end token's text
        none = client.chat.completions.create(**{**kw, "tool_choice": "none"},
                                              extra_body={"skip_special_tokens": False})
        assert none.choices[0].message.content == "".join(CALL_PIECES)
    finally:
        assert srv.stop() == 0, srv.read_log()


def test_tool_errors_over_http_have_openai_shape(server: Server, tool_model: str) -> None:
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    expect_error(post(server, chat, {"model": tool_model, "messages": user, "tools": TOOLS,
                                     "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                 400, "'nope', which is not in tools", param="tool_choice")
    expect_error(post(server, chat, {"model": tool_model, "messages": [{"role": "assistant", "content": None}]}),
                 400, "needs content or tool_calls", param="messages")
    ok = post(server, chat, {"model": tool_model, "messages": HISTORY, "max_tokens": 2})   # history, no tools
    assert ok.status_code == 200, ok.text
    # a lone surrogate in any key or string of a request with tools and a tool-call history, or inside a call's
    # arguments (JSON in a string): 400 naming where, never a 500
    body = {"model": tool_model, "messages": HISTORY, "max_tokens": 2, "tools": TOOLS, "tool_choice": "none"}
    assert post(server, chat, body).status_code == 200
    for bad, where in with_surrogate(body):
        expect_error(post(server, chat, None, raw=json.dumps(bad).encode()), 400, "surrogate", param=where)
    call = next(m for m in HISTORY if m.get("tool_calls"))["tool_calls"][0]
    bad_call = {**call, "function": {**call["function"], "arguments": '{"city": "\\ud800"}'}}
    resp = post(server, chat, {**body, "messages": [*HISTORY, {"role": "assistant", "tool_calls": [bad_call]}]})
    expect_error(resp, 400, "function.arguments", "surrogate")


# ---- auto mode through the real serving code, with a scripted engine -----------------------------------------------
class _ScriptedEngine:
    """Stands in for :class:`AsyncEngine`: choice ``i`` of every request "generates" ``texts[i]``, ``step``
    characters (one token) per engine step, then finishes with ``stop``. A random model writes no ``<tool_call>``
    blocks; this one does, so auto mode's parsing runs through ``OpenAIServing`` end to end."""

    def __init__(self, vocab_size: int, texts: list[str], step: int = 3) -> None:
        self.engine = SimpleNamespace(config=SimpleNamespace(arch=SimpleNamespace(vocab_size=vocab_size)))
        self.texts, self.step = texts, step

    async def add(self, request_id: str, prompt_ids: list[int], params: Any, mailbox: Any) -> None:
        asyncio.get_running_loop().create_task(self._play(request_id, prompt_ids, params.n, mailbox))

    async def _play(self, request_id: str, prompt_ids: list[int], n: int, mailbox: Any) -> None:
        steps = max(math.ceil(len(t) / self.step) for t in self.texts[:n])
        for k in range(1, steps + 1):
            outs = []
            for i, text in enumerate(self.texts[:n]):
                cut = min(len(text), k * self.step)
                outs.append(CompletionOutput(i, text[:cut], list(range(math.ceil(cut / self.step))), None, None,
                                             "stop" if cut == len(text) else None))
            mailbox.put_nowait((request_id, RequestOutput(request_id, None, prompt_ids, None, outs,
                                                          all(o.finish_reason for o in outs))))
            await asyncio.sleep(0)

    def abort(self, request_id: str) -> None:
        pass


AUTO_TEXTS = ['Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
              "No tools needed: it is <b>sunny</b>."]


def _scripted_serving(tool_model: str, texts: list[str]) -> tuple[OpenAIServing, _ScriptedEngine]:
    """An OpenAIServing (auto tool choice on, hermes) whose engine "generates" ``texts``."""
    tokenizer = ServerTokenizer(load_tokenizer("hf", tool_model))
    limits = ServingLimits(served_model_name="m", max_model_len=1024, max_tokens=1024, max_n=4, max_in_flight=8,
                           kv_capacity_tokens=64 * 16, kv_block_size=16)
    engine = _ScriptedEngine(len(tokenizer.tokenizer), texts)
    serving = OpenAIServing(engine, limits, ServerMetrics(), tokenizer, ToolOptions(True, "hermes"))  # type: ignore[arg-type]
    return serving, engine


def _answer_both_ways(serving: OpenAIServing, body: dict[str, Any]) -> tuple[dict[str, Any], Any, Any, list[Any]]:
    """The non-streamed answer to ``body``; the streamed one as the openai SDK accumulates it, its usage, and its
    chunks."""
    async def never() -> None:
        await asyncio.Event().wait()

    async def scenario() -> tuple[dict[str, Any], Any, Any, list[Any]]:
        plain = await serving.chat(_request(**body), never)
        stream = await serving.chat(_request(**body, stream=True, stream_options={"include_usage": True}), never)
        assert isinstance(plain, dict) and isinstance(stream, Stream)
        state, usage, chunks = ChatCompletionStreamState(), None, []
        async for event in stream.chunks:
            payload = event.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            chunk = openai.types.chat.ChatCompletionChunk.model_validate(json.loads(payload))
            chunks.append(chunk)
            usage = chunk.usage or usage
            if chunk.choices:
                state.handle_chunk(chunk)
        return plain, state.current_completion_snapshot, usage, chunks

    return asyncio.run(scenario())


def test_auto_mode_parses_hermes_calls_in_answers_and_streams(tool_model: str) -> None:
    serving, engine = _scripted_serving(tool_model, AUTO_TEXTS)
    body = dict(messages=[{"role": "user", "content": "Weather in Zürich?"}], tools=TOOLS, n=2)
    plain, streamed, usage, _ = _answer_both_ways(serving, body)
    calls, text_only = plain["choices"]
    assert calls["finish_reason"] == "tool_calls"
    assert calls["message"]["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Zürich", "days": 2}), ("get_time", {})]
    assert text_only == {"index": 1, "message": {"role": "assistant", "content": AUTO_TEXTS[1]}, "logprobs": None,
                         "finish_reason": "stop"}
    _same_answer(streamed, openai.types.chat.ChatCompletion.model_validate(plain))
    assert usage is not None and usage.model_dump(exclude_none=True) == plain["usage"]
    tokens = sum(math.ceil(len(t) / engine.step) for t in AUTO_TEXTS)
    assert plain["usage"]["completion_tokens"] == tokens


# tool_choice -> what the model "writes" (its grammar's shape) and the content OpenAI answers: none for a call
CONTENT_CASES = [
    ("auto", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None),
    ("auto", "No call: it is sunny.", "No call: it is sunny."),
    ("required", '[{"name": "get_time", "parameters": {}}]', None),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo", "days": 1}', None),
    ("none", "Plain text.", "Plain text."),
]


@pytest.mark.parametrize("choice,text,content", CONTENT_CASES)
def test_the_role_chunk_content_and_the_streamed_content_match_the_answer_in_every_tool_mode(
        tool_model: str, choice: Any, text: str, content: str | None) -> None:
    """Issue 42, item 4: a stream's first chunk (the role) carries ``content: null`` whenever tools may be called
    (auto, required, named; OpenAI sends null with tool calls) and ``""`` without tools' parsing (none), so the
    openai SDK's accumulated streamed message has exactly the non-streamed answer's content: None for an answer
    that is only calls (auto used to stream ``''``), the text otherwise."""
    serving, _ = _scripted_serving(tool_model, [text])
    body = dict(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=choice)
    plain, streamed, _, chunks = _answer_both_ways(serving, body)
    assert plain["choices"][0]["message"]["content"] == content
    assert streamed.choices[0].message.content == content      # exactly: None is not ""
    role = chunks[0].choices[0].delta
    assert role.role == "assistant" and role.content == (None if choice != "none" else "")
    assert bool(plain["choices"][0]["message"].get("tool_calls")) == (content is None)
