"""``POST /v1/responses`` (OpenAI's Responses API, :mod:`kv8.entrypoints.openai.responses`) of a real ``kv8 serve``
through the official ``openai`` client's ``client.responses``.

The model is :func:`tests.helpers.tiny_models.make_calling_model`'s: a tiny Llama with a tool-capable template that
answers every conversation with one hermes call to ``get_time`` and then EOS, so that a plain answer finishes
(``completed``) with a known text, and ``tool_choice`` auto yields a real call; named and required calls, and
json_schema output, are constrained by their grammars. Oracles: the same request on ``/v1/chat/completions``
(text, calls, usage), ``/tokenize`` (the rendered prompt's length), ``jsonschema``, and the SDK's own stream
accumulator (``client.responses.stream``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.helpers.server import API_KEY, SERVER_FLAGS, Server, expect_error, post
from tests.helpers.tiny_models import CALL_PIECES, make_calling_model

FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "16", "--max-model-len", "1024",
         "--max-num-seqs", "8", "--no-adaptive-cpu-threads"]
ANSWER = "".join(CALL_PIECES)    # what the model writes, whatever it is asked
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast for a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "description": "The time now"}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_calling_model(str(tmp_path_factory.mktemp("calling")))


@pytest.fixture(scope="module")
def server(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("responses_server") / "server.log")
    srv = Server(["serve", "--model-id", model, "--api-key", API_KEY, *FLAGS, *SERVER_FLAGS,
                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], log, env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() == 0, srv.read_log()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)


def _events(client: openai.OpenAI, **kw: Any) -> list[Any]:
    return list(client.responses.create(stream=True, **kw))


def _counts(usage: Any) -> tuple[int, int, int]:
    return usage.input_tokens, usage.output_tokens, usage.total_tokens


# ---- text -----------------------------------------------------------------------------------------------------------
def test_a_response_answers_as_chat_does(client: openai.OpenAI, server: Server, model: str) -> None:
    """A string input with instructions: one completed message whose text is the chat answer to the same
    conversation (instructions as its system message), usage counting the rendered prompt and every generated
    token; a list input of message items (developer role, input_text parts) is the same conversation; the
    settings are echoed, store false."""
    kw = dict(model=model, temperature=0.0, max_output_tokens=16)
    resp = client.responses.create(input="What time is it?", instructions="Be brief.", **kw)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == model
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    assert [item.type for item in resp.output] == ["message"]
    message = resp.output[0]
    assert message.role == "assistant" and message.status == "completed" and message.id.startswith("msg_")
    assert [(part.type, part.text) for part in message.content] == [("output_text", ANSWER)]
    assert resp.output_text == ANSWER
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it?"}]
    chat = client.chat.completions.create(model=model, messages=msgs, temperature=0.0, max_tokens=16)
    assert chat.choices[0].message.content == ANSWER
    prompt = post(server, "/tokenize", {"messages": msgs}).json()["count"]
    assert _counts(resp.usage) == (prompt, len(CALL_PIECES) + 1, prompt + len(CALL_PIECES) + 1)   # EOS counted
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (prompt, len(CALL_PIECES) + 1)
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 16 and resp.temperature == 0.0
    assert resp.tools == [] and resp.tool_choice == "auto" and resp.text.format.type == "text"
    assert resp.model_extra is not None and resp.model_extra.get("store") is False   # nothing is stored
    items = client.responses.create(input=[{"role": "developer", "content": "Be brief."},
                                           {"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "What time is it?"}]}],
                                    store=True, metadata={"k": "v"}, user="u-1", **kw)
    assert items.output_text == ANSWER and _counts(items.usage) == _counts(resp.usage)
    assert items.metadata == {"k": "v"}
    raw = post(server, "/v1/responses", {"model": model, "input": "What time is it?", "max_output_tokens": 16})
    Response.model_validate(raw.json())   # every field the SDK's type requires, with its type


def test_max_output_tokens_leaves_the_response_incomplete(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, input="What time is it?", temperature=0.0, max_output_tokens=2)
    resp = client.responses.create(**kw)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.output_text == "".join(CALL_PIECES[:2])
    assert resp.usage.output_tokens == 2
    events = _events(client, **kw)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.output_text == resp.output_text


MESSAGE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done", "response.completed"]


def _collapse(types: list[str]) -> list[str]:
    """Event types with runs of deltas as one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_a_streamed_response_sends_the_event_sequence(client: openai.OpenAI, server: Server, model: str) -> None:
    """Streamed: OpenAI's event sequence in order, sequence numbers 0, 1, 2 ..., deltas joining to the done text
    and to the non-streamed text; the final response equals the non-streamed one (output, usage counts); the SDK's
    stream helper accumulates it; on the wire each event is ``event: <type>`` / ``data: {...}`` (valid as the SDK's
    event types), with no ``[DONE]``."""
    kw = dict(model=model, input="What time is it?", temperature=0.0, max_output_tokens=16)
    plain = client.responses.create(**kw)
    events = _events(client, **kw)
    types = [e.type for e in events]
    assert _collapse(types) == MESSAGE_EVENTS, types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert all(deltas) and "".join(deltas) == ANSWER   # tokens that arrive between two reads come as one delta
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text == plain.output_text
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    assert final.status == "completed" and final.output_text == plain.output_text
    assert _counts(final.usage) == _counts(plain.usage)
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.id == final.output[0].id == done.item_id and added.output_index == 0
    with client.responses.stream(**kw) as stream:   # the SDK's accumulator
        for _ in stream:
            pass
        accumulated = stream.get_final_response()
    assert accumulated.output_text == plain.output_text and accumulated.status == "completed"
    with httpx.stream("POST", server.url + "/v1/responses", json={**kw, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        blocks = "".join(resp.iter_text()).strip().split("\n\n")
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)   # every field the SDK's types require, with its type
    wire = []
    for block in blocks:
        head, data = block.split("\n")
        wire.append(adapter.validate_json(data.removeprefix("data: ")).type)
        assert head == f"event: {wire[-1]}"
    assert _collapse(wire) == MESSAGE_EVENTS and "[DONE]" not in blocks[-1]


# ---- tools ----------------------------------------------------------------------------------------------------------
def _calls(resp: Any) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in resp.output if item.type == "function_call"]


def test_a_named_function_call_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    """A forced call (tool_choice naming a function): one function_call item, its arguments matching the
    function's schema (constrained decoding), the chat route's call for the same request; streamed, its item is
    added with the name and call id, then the arguments arrive in deltas that join to the done arguments, and the
    final response has the non-streamed call."""
    kw = dict(model=model, input="Weather in Oslo?", tools=TOOLS, temperature=0.0, max_output_tokens=100,
              tool_choice={"type": "function", "name": "get_weather"})
    resp = client.responses.create(**kw)
    assert resp.status == "completed" and [item.type for item in resp.output] == ["function_call"]
    call = resp.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert resp.tool_choice.name == "get_weather" and [t.name for t in resp.tools] == ["get_weather", "get_time"]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          tools=CHAT_TOOLS, temperature=0.0, max_tokens=100,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls] == _calls(resp)
    events = _events(client, **kw)
    assert _collapse([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added = events[2]
    assert (added.item.type, added.item.name, added.item.arguments) == ("function_call", "get_weather", "")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert all(deltas) and "".join(deltas) == done.arguments == call.arguments
    assert _calls(events[-1].response) == _calls(resp) and events[-1].response.output[0].call_id == added.item.call_id


def test_auto_and_required_tool_choice_answer_with_calls(client: openai.OpenAI, model: str) -> None:
    """tool_choice auto (the default with tools; the server runs the hermes parser): the model's call becomes a
    function_call item and no message, streamed too (sent once the generation ends); required with
    parallel_tool_calls false: exactly one call matching its schema."""
    kw = dict(model=model, input="What time is it?", tools=TOOLS, temperature=0.0, max_output_tokens=16)
    auto = client.responses.create(**kw)
    assert auto.status == "completed" and _calls(auto) == [("get_time", "{}")]
    assert [item.type for item in auto.output] == ["function_call"]
    events = _events(client, **kw)
    assert _collapse([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert _calls(events[-1].response) == _calls(auto)
    required = client.responses.create(**{**kw, "max_output_tokens": 100}, tool_choice="required",
                                       parallel_tool_calls=False)
    assert required.status == "completed" and len(_calls(required)) == 1 and not required.parallel_tool_calls
    name, arguments = _calls(required)[0]
    jsonschema.validate(json.loads(arguments), WEATHER if name == "get_weather" else {"type": "object"})


def test_a_function_call_round_trip(client: openai.OpenAI, server: Server, model: str) -> None:
    """The agent loop: the first response's output items (its function_call) and a function_call_output for
    it go back as input; the server renders them as the chat history (an assistant turn with the call, a tool
    reply), which /tokenize of that history confirms token for token, and answers."""
    first = client.responses.create(model=model, input="What time is it?", tools=TOOLS, temperature=0.0,
                                    max_output_tokens=16)
    call = first.output[0]
    assert call.type == "function_call"
    history: list[Any] = [{"role": "user", "content": "What time is it?"}, *first.output,
                          {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    second = client.responses.create(model=model, input=history, tools=TOOLS, temperature=0.0,
                                     max_output_tokens=16)
    assert second.status == "completed" and second.output
    function = {"name": call.name, "arguments": call.arguments}
    chat = [{"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                   "function": function}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}]
    rendered = post(server, "/tokenize", {"messages": chat, "tools": CHAT_TOOLS}).json()["count"]
    assert second.usage.input_tokens == rendered > first.usage.input_tokens
    # a reply's output may also be input_text parts; a message before the calls is their assistant turn
    again = client.responses.create(model=model, tools=TOOLS, temperature=0.0, max_output_tokens=16, input=[
        history[0], {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}, call,
        {"type": "function_call_output", "call_id": call.call_id, "output": [{"type": "input_text", "text": "12:00"}]}])
    chat[1]["content"] = "Checking."
    rendered = post(server, "/tokenize", {"messages": chat, "tools": CHAT_TOOLS}).json()["count"]
    assert again.usage.input_tokens == rendered


# ---- structured output ----------------------------------------------------------------------------------------------
class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    days: int = pydantic.Field(ge=1, le=7)


def test_text_format_json_schema_and_json_object(client: openai.OpenAI, model: str) -> None:
    """text.format json_schema constrains the output as chat's response_format does: it parses and matches the
    schema (the SDK's responses.parse with a pydantic model too); json_object gives a JSON object."""
    kw = dict(model=model, input="Weather?", temperature=0.0, max_output_tokens=100)
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    resp = client.responses.create(text={"format": fmt}, **kw)
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), WEATHER)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "weather"
    parsed = client.responses.parse(text_format=City, **kw)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    obj = client.responses.create(text={"format": {"type": "json_object"}}, **kw)
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


# ---- what it does not do --------------------------------------------------------------------------------------------
REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"conversation": "conv_1"}, "conversation", "stateless"),
    ({"background": True}, "background", "stateless"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning options are not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include is not supported"),
    ({"truncation": "auto"}, "truncation", "truncation 'auto' is not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "built-in tool 'web_search'"),
    ({"tools": [TOOLS[0], {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.1", "'file_search'"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "'web_search_preview'"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "id": "rs_1", "summary": []}]}, "input.1",
     "reasoning item"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "stateless"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input.0",
     "type 'web_search_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input.0.content.1", "text-only model: content part type 'input_image'"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input.1",
     "no earlier function_call"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope', which is not in"),
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "text.format", "cannot be combined"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, "text.format",
     "text.format"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "above this server's limit"),
    ({"input": "word " * 2000}, "input", "maximum context length"),
    ({"input": []}, "input", "empty list"),
    ({"top_logprobs": 2}, "top_logprobs", "unknown or unsupported field"),
]


@pytest.mark.parametrize("extra,param,fragment", REFUSED, ids=[r[1] + ":" + r[2][:20] for r in REFUSED])
def test_what_it_does_not_support_is_a_400_naming_the_field(client: openai.OpenAI, model: str, extra: dict[str, Any],
                                                            param: str, fragment: str) -> None:
    body = {"model": model, "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert fragment in error["message"], error


def test_accepted_no_op_fields_and_other_errors(server: Server, model: str) -> None:
    """Values of the refused fields that change nothing are accepted (store true stores nothing); an unknown model
    is a 404, a missing key a 401, as on every route."""
    body = {"model": model, "input": "hi", "max_output_tokens": 2}
    ok = post(server, "/v1/responses", {**body, "store": True, "background": False, "include": [], "reasoning": None,
                                        "truncation": "disabled", "previous_response_id": None,
                                        "stream_options": None, "parallel_tool_calls": True, "tools": [],
                                        "tool_choice": "auto"})
    assert ok.status_code == 200 and ok.json()["store"] is False, ok.text
    expect_error(post(server, "/v1/responses", {**body, "model": "other"}), 404, "does not exist", param="model")
    expect_error(post(server, "/v1/responses", body, key=None), 401, "API key")
    expect_error(post(server, "/v1/responses", {**body, "stream_options": {"include_obfuscation": False}}), 400,
                 "only allowed when stream is true", param="stream_options")


# ---- the event stream of an auto answer (no server: the parser's deltas fed to ResponseEvents) --------------------
AUTO_CASES = [
    'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> Done, <b>then</b> more.',
    "No call at all.",
    "",
]


@pytest.mark.parametrize("text", AUTO_CASES)
@pytest.mark.parametrize("step", [1, 4])
def test_streamed_auto_output_equals_the_non_streamed_output(text: str, step: int) -> None:
    """tool_choice auto, the hermes parser's deltas of a growing text (``step`` characters at a time) through
    ResponseEvents: the final response's output (the message first, then the calls, whatever came first in the
    text) equals output_items of the non-streamed message; the openai SDK parses every event, and each item's
    deltas join to its done text / arguments."""
    from kv8.entrypoints.openai.responses import (
        ResponseEvents,
        ResponsesRequest,
        output_items,
        response_object,
        usage,
    )
    from kv8.entrypoints.openai.tool_calling import HermesParser, ToolCallStream, ToolPlan

    plan = ToolPlan("auto", None, HermesParser(frozenset({"get_weather", "get_time"})))
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": TOOLS})
    events = ResponseEvents(response_object(req, "resp_1", 0, "m"), defer_calls=True)
    calls, sse = ToolCallStream(), events.start()
    for end in [*range(step, len(text), step), len(text)]:
        sse += events.step(*calls.step(plan.parser.parse(text[:end], final=end == len(text))))  # type: ignore[union-attr]
    sse += events.finish(False, usage(5, 3, 2))
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(json.loads(block.split("\n")[1].removeprefix("data: "))) for block in sse]
    final = parsed[-1].response  # type: ignore[union-attr]
    expected = output_items(plan.message(text, "stop")[0], False)
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == \
        [(i["type"], i.get("name"), i.get("arguments")) for i in expected]
    assert final.output_text == "".join(p["text"] for i in expected if i["type"] == "message" for p in i["content"])
    for index, item in enumerate(final.output):
        pieces = [e.delta for e in parsed if e.type.endswith(".delta") and e.output_index == index]  # type: ignore[union-attr]
        assert "".join(pieces) == (item.content[0].text if item.type == "message" else item.arguments)
