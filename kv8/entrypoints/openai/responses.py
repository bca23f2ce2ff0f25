"""OpenAI's Responses API (``POST /v1/responses``), stateless, served by the chat route's machinery.

A request is validated strictly (:class:`ResponsesRequest`) and converted to the equivalent
:class:`ChatCompletionRequest` (:meth:`ResponsesRequest.chat_request`): ``instructions`` becomes a leading system
message; ``input`` (a string: one user message; or a list of items) becomes chat messages: ``message`` items
(roles user, system, developer, assistant; content a string or ``input_text`` / ``output_text`` parts) as they
are, ``function_call`` items as ``tool_calls`` of the assistant turn they follow (a new one after anything else),
``function_call_output`` items as ``tool`` messages; function tools get chat's shape, ``text.format`` becomes
``response_format`` and ``max_output_tokens`` the completion-token limit. The chat route's machinery then serves
it (:meth:`kv8.entrypoints.openai.serving.OpenAIServing.responses`): the chat template, tool planning and parsing
(:mod:`kv8.entrypoints.openai.tool_calling`), structured output. Its answer becomes Responses output items
(:func:`output_items`): the message (when it has text, or when there is no call) first, then one ``function_call``
item per call; or, streamed, the event sequence of :class:`ResponseEvents`.

Stateless: nothing is stored. ``store`` is accepted (clients send it) and the response says ``"store": false``.
What needs stored state (``previous_response_id``, ``conversation``, ``item_reference`` items, ``background``,
stored ``prompt`` templates), built-in tools (``web_search``, ``file_search`` ...), reasoning items and
``reasoning`` options, ``include``, ``truncation: "auto"`` and non-text content parts are each a 400 naming the
field (:data:`REFUSED_FIELDS`); any other unknown field is a 400 too.

Status: ``completed``, or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` when the
token limit cut the answer. ``usage``: ``input_tokens`` (the rendered prompt; ``input_tokens_details.cached_tokens``
those found in the prefix cache), ``output_tokens`` (every generated token), ``total_tokens``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from kv8.entrypoints.openai.protocol import (
    TOOL_NAME_PATTERN,
    APIError,
    ChatCompletionRequest,
    FieldError,
    StrictModel,
    check_call_arguments,
    refuse_non_text_parts,
    validation_error,
)

#: the text part types a message item's content may hold (``output_text``: an earlier answer sent back)
TEXT_PART_TYPES = ("input_text", "output_text")
#: the input item types kv8 takes; every other type is a 400 naming the item
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")

_STATELESS = ("kv8 serves the Responses API statelessly: it stores no responses or conversations, so {what}; "
              "send the whole conversation in input (earlier output items included)")
#: fields whose use a 400 refuses, naming the field: (the values that change nothing and are accepted, why not)
REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((None,), _STATELESS.format(what="previous_response_id cannot be resolved")),
    "conversation": ((None,), _STATELESS.format(what="conversation cannot be resolved")),
    "background": ((None, False), _STATELESS.format(what="a background response could not be retrieved")),
    "prompt": ((None,), _STATELESS.format(what="stored prompt templates cannot be used")),
    "reasoning": ((None, {}), "reasoning options are not supported: kv8 has no reasoning effort or reasoning "
                              "summaries to control"),
    "include": ((None, []), "include is not supported: kv8 has no extra output data (reasoning, logprobs, tool "
                            "results) to add"),
    "truncation": ((None, "disabled"), "truncation 'auto' is not supported: kv8 does not drop input to fit the "
                                       "context (an input that does not fit is a 400)"),
}


def new_item_id(prefix: str) -> str:
    """An output item's id: ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request ------------------------------------------------------------------------------------------------------
class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """An earlier answer's text part, sent back in ``input`` (its annotations and logprobs are not read)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


ContentPart = Annotated[InputText | OutputText, Field(discriminator="type")]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(StrictModel):
    """A message (``type`` may be left out, as the SDK's "easy" input messages do). ``id`` and ``status`` (an
    earlier output item sent back) are accepted and not read."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    """A call an earlier answer made (an output item sent back): ``arguments`` a JSON object encoded as a string."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None

    @model_validator(mode="after")
    def _check_arguments(self) -> FunctionCallItem:
        check_call_arguments(self.name, self.arguments, field="arguments")
        return self


class FunctionCallOutputItem(StrictModel):
    """The result of the call ``call_id``: text, or ``input_text`` parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_type(value: Any) -> Any:
    """An input item's ``type``; a message's may be left out."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type)]


class FunctionTool(StrictModel):
    """A function the model may call (the Responses shape: ``name`` and ``parameters`` at the top level)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_dict(self) -> dict[str, Any]:
        fn = {k: v for k, v in (("name", self.name), ("description", self.description),
                                ("parameters", self.parameters), ("strict", self.strict)) if v is not None}
        return {"type": "function", "function": fn}

    def echo(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


class FunctionToolChoice(StrictModel):
    """``tool_choice`` naming one function: the model must call it."""

    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJSONObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(StrictModel):
    """Output matching a JSON schema (``name``, ``schema`` at the top level, unlike chat's ``json_schema``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None   # accepted; kv8 adds no obfuscation padding to its events


def _refuse_unsupported(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the refused fields' no-op values; a :class:`FieldError` naming the first field, tool,
    ``tool_choice``, input item or content part kv8 does not support (see the module docstring)."""
    data = dict(data)
    for name, (accepted, why) in REFUSED_FIELDS.items():
        if name in data:
            value = data.pop(name)
            unset = isinstance(value, dict) and all(v is None for v in value.values())   # {"effort": null}
            if not unset and not any(value == ok and type(value) is type(ok) for ok in accepted):
                raise FieldError(name, f"{name} is not supported: {why}")
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise FieldError(f"tools.{i}", f"tools.{i} is the built-in tool {kind!r}, which kv8 does not have; only "
                                           "function tools ({'type': 'function', 'name': ...}) are supported")
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
        raise FieldError("tool_choice", f"tool_choice of type {choice['type']!r} is not supported: give 'none', "
                                        "'auto', 'required' or {'type': 'function', 'name': ...}")
    items = data.get("input")
    if isinstance(items, list):
        for i, item in enumerate(items):
            kind = _item_type(item) if isinstance(item, dict) else None
            if kind == "reasoning":
                raise FieldError(f"input.{i}", f"input.{i} is a reasoning item, which is not supported: kv8 serves "
                                               "no reasoning items; leave them out of input")
            if kind == "item_reference":
                raise FieldError(f"input.{i}", f"input.{i} is an item_reference: "
                                 + _STATELESS.format(what="no item can be referenced"))
            if isinstance(kind, str) and kind not in INPUT_ITEM_TYPES:
                raise FieldError(f"input.{i}", f"input.{i} has type {kind!r}, which is not supported; kv8 takes "
                                               f"input items of types {', '.join(map(repr, INPUT_ITEM_TYPES))}")
        refuse_non_text_parts(items, "input", TEXT_PART_TYPES)
        refuse_non_text_parts(items, "input", ("input_text",), key="output")
    return data


class ResponsesRequest(StrictModel):
    """POST /v1/responses (see the module docstring). ``tool_choice`` defaults to ``auto`` with tools, as in
    OpenAI's API (the server's ``--enable-auto-tool-choice`` needed, as on chat); ``auto`` without tools (or with
    ``tools: []``) is plain text, ``required`` or a named function without them a 400. ``text.format``
    json_object / json_schema constrains the output as chat's ``response_format`` does, and cannot be combined with
    tools and a ``tool_choice`` other than ``none``. Function call ids are distinct, and every
    ``function_call_output`` answers an earlier ``function_call`` of ``input``."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    # accepted and ignored, as on chat: none of them changes what is generated (store: nothing is ever stored)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        return _refuse_unsupported(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input:
            raise FieldError("input", "input is an empty list; give a string or at least one item")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        called: set[str] = set()
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            if isinstance(item, FunctionCallItem):
                if item.call_id in called:
                    raise FieldError(f"input.{i}", f"input.{i} is a second function_call with call_id "
                                                   f"{item.call_id!r}; call ids must be distinct")
                called.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
                raise FieldError(f"input.{i}", f"input.{i} is a function_call_output for call_id {item.call_id!r}, "
                                               "which no earlier function_call item in input made (called: "
                                               f"{sorted(called) or 'none'})")
        names = [t.name for t in self.tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise FieldError("tools", f"tools has more than one function named {', '.join(map(repr, twice))}; "
                                      "function names must be distinct")
        choice = self.tool_choice
        if choice is not None and choice not in ("none", "auto") and not names:   # auto without tools: plain text
            shown = choice if isinstance(choice, str) else choice.model_dump()
            raise FieldError("tool_choice", f"tool_choice {shown!r} requires tools; give the functions in tools")
        if isinstance(choice, FunctionToolChoice) and choice.name not in names:
            raise FieldError("tool_choice", f"tool_choice names function {choice.name!r}, which is not in tools "
                                            f"(functions: {', '.join(map(repr, names))})")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text" and names and choice != "none":
            raise FieldError("text.format", f"text.format {fmt.type!r} cannot be combined with tools and tool_choice "
                                            f"{choice or 'auto'!r}: both would constrain the same output; drop one, "
                                            "or set tool_choice to 'none'")
        return self

    # ---- the equivalent chat request ----------------------------------------------------------------------------
    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (see the module docstring)."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":   # the turn the call belongs to
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return messages

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request that asks for the same answer; a 400 naming ``input`` if the conversation
        is not one a chat request can hold."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(),
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [t.chat_dict() for t in self.tools]
        choice = self.tool_choice
        if self.tools:
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
                if isinstance(choice, FunctionToolChoice) else choice
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, TextFormatJSONSchema):
            spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = validation_error(e)
            raise APIError(400, f"input, as chat messages: {err.message}", param="input") from e

    # ---- what the response echoes -------------------------------------------------------------------------------
    def echo(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them (defaults filled in)."""
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, TextFormatJSONSchema):
            shown: dict[str, Any] = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_,
                                     "description": fmt.description, "strict": fmt.strict}
        else:
            shown = {"type": fmt.type if fmt is not None else "text"}
        choice = self.tool_choice
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "tool_choice": choice.model_dump() if isinstance(choice, FunctionToolChoice) else (choice or "auto"),
                "tools": [t.echo() for t in self.tools or ()], "text": {"format": shown},
                "metadata": dict(self.metadata or {}), "user": self.user, "store": False, "background": False,
                "previous_response_id": None, "reasoning": None, "truncation": "disabled", "max_tool_calls": None}


#: the chat machinery's error params and what the Responses request calls them
_PARAMS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def renamed(e: APIError) -> APIError:
    """A 400 of the chat machinery with its ``param`` (and the field its message starts with) as the Responses
    request names it; other errors as they are."""
    if e.param not in _PARAMS:
        return e
    name = _PARAMS[e.param]
    message = e.message
    if message.startswith(f"{e.param}:"):
        message = name + message[len(e.param):]
    elif e.param == "messages":
        message += " (input, as chat messages: instructions first, function_call items in their assistant turn)"
    return APIError(e.status, message, e.type, name, e.code, e.headers, e.request_id)


# ---- response -----------------------------------------------------------------------------------------------------
def response_object(req: ResponsesRequest, response_id: str, created: int, model: str) -> dict[str, Any]:
    """The response of ``req`` while in progress: no output, no usage yet."""
    return {"id": response_id, "object": "response", "created_at": created, "status": "in_progress", "model": model,
            "output": [], "usage": None, "error": None, "incomplete_details": None, "completed_at": None,
            **req.echo()}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def finish(response: dict[str, Any], incomplete: bool, usage_: dict[str, Any]) -> dict[str, Any]:
    """``response`` finished: its status (``incomplete`` when ``max_output_tokens`` cut it), usage and time."""
    response.update(status="incomplete" if incomplete else "completed", usage=usage_,
                    incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                    completed_at=int(time.time()))
    return response


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [_text_part(text)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(message: dict[str, Any], incomplete: bool) -> list[dict[str, Any]]:
    """A finished chat ``message`` (``ToolPlan.message``) as output items: the message when it has text or there
    is no call (its text "" then), then one ``function_call`` item per call."""
    status = "incomplete" if incomplete else "completed"
    calls = message.get("tool_calls") or []
    items = []
    if message.get("content") or not calls:
        items.append(message_item(new_item_id("msg"), message.get("content") or "", status))
    items += [call_item(new_item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], status)
              for c in calls]
    return items


class ResponseEvents:
    """The server-sent events of one streamed response, built from the text and call deltas of its generation
    (:class:`kv8.entrypoints.openai.tool_calling.ToolCallStream`'s).

    Events, each ``event: <type>`` and ``data: {...}`` with the next ``sequence_number`` (no ``[DONE]``, as
    OpenAI's): :meth:`start`: ``response.created``, ``response.in_progress``. :meth:`step`: on the first text,
    the message's ``response.output_item.added`` and ``response.content_part.added``, then
    ``response.output_text.delta`` per piece; per new call its ``response.output_item.added`` (name, call id),
    then ``response.function_call_arguments.delta`` per piece. :meth:`finish`: an empty message if there was no
    text and no call; then per item in output order ``response.output_text.done``, ``response.content_part.done``
    and ``response.output_item.done`` (the message) or ``response.function_call_arguments.done`` and
    ``response.output_item.done`` (a call); last ``response.completed`` or ``response.incomplete`` with the whole
    response. :meth:`fail`: ``error``, then ``response.failed``.

    Invariant: the output is the non-streamed one's (:func:`output_items`): the message, if any, first, then the
    calls. With ``defer_calls`` (tool_choice auto: text may come before calls, and calls arrive whole anyway) calls
    are sent at :meth:`finish`, after the text; otherwise (named, required) there is no text and they stream."""

    def __init__(self, response: dict[str, Any], defer_calls: bool) -> None:
        self.response = response
        self.defer_calls = defer_calls
        self.sequence = 0
        self.message: dict[str, Any] | None = None
        self.calls: list[dict[str, Any]] = []
        self.deferred: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.response["output"]) if it is item)

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def _open_message(self) -> list[str]:
        item: dict[str, Any] = {"id": new_item_id("msg"), "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}
        self.response["output"].append(item)
        events: list[str] = [self._event("response.output_item.added", output_index=self._index(item), item=item)]
        item["content"].append(_text_part(""))
        self.message = item
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(item),
                                  content_index=0, part=item["content"][0]))
        return events

    def _call(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        arguments = delta["function"].get("arguments", "")
        if "id" in delta:   # a new call: its item first
            item = call_item(new_item_id("fc"), delta["id"], delta["function"]["name"], "", "in_progress")
            self.response["output"].append(item)
            self.calls.append(item)
            events.append(self._event("response.output_item.added", output_index=self._index(item), item=item))
        item = self.calls[delta["index"]]
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index(item), delta=arguments))
        return events

    def step(self, text: str, calls: list[dict[str, Any]]) -> list[str]:
        """The events of new ``text`` and of new ``calls`` deltas (``delta.tool_calls`` entries)."""
        events: list[str] = []
        if text:
            if self.message is None:
                events += self._open_message()
            assert self.message is not None
            part = self.message["content"][0]
            part["text"] += text
            events.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                      output_index=self._index(self.message), content_index=0, delta=text,
                                      logprobs=[]))
        for delta in calls:
            if self.defer_calls:
                self.deferred.append(delta)
            else:
                events += self._call(delta)
        return events

    def finish(self, incomplete: bool, usage_: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if self.message is None and not self.calls and not self.deferred:
            events += self._open_message()
        for delta in self.deferred:
            events += self._call(delta)
        self.deferred = []
        status = "incomplete" if incomplete else "completed"
        for index, item in enumerate(self.response["output"]):
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                       content_index=0, text=part["text"], logprobs=[]),
                           self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                       content_index=0, part=part)]
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        finish(self.response, incomplete, usage_)
        events.append(self._event("response.incomplete" if incomplete else "response.completed",
                                  response=self.response))
        return events

    def fail(self, error: APIError) -> list[str]:
        """The events that end a stream whose generation failed with ``error`` (a 5xx: the engine's)."""
        self.response.update(status="failed", error={"code": "server_error", "message": error.message})
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=self.response)]
