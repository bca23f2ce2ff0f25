"""OpenAI tool calling for /v1/chat/completions: how ``tool_choice`` is decoded, and generated text -> ``tool_calls``.

Modes (:attr:`ChatCompletionRequest.tool_mode`), as vLLM implements them:

============  ======================================================================================================
``none``      no tool calls: the text is the message's content. The chat template still gets ``tools`` (vLLM's
              default), so the model knows them; nothing is parsed.
``named``     the output is constrained (llguidance, :mod:`kv8.engine.structured`) to the function's arguments
              schema; the whole output is that call's ``arguments``. ``finish_reason`` stays ``stop`` (OpenAI and
              vLLM answer ``stop``, not ``tool_calls``, for a forced function).
``required``  the output is constrained to a JSON array of one or more ``{"name": <a tool's name>, "parameters":
              <that tool's arguments>}`` objects (at most one with ``parallel_tool_calls: false``); each becomes a
              call, ``finish_reason`` ``tool_calls``.
``auto``      needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``. Decoding is not constrained (as in
              vLLM); the parser (``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the
              format of Hermes 2 Pro / 3 and Qwen 2.5 / 3) takes the calls out of the text and leaves the rest as
              content; ``finish_reason`` ``tool_calls`` when it found any.
============  ======================================================================================================

Output parsers (:class:`NamedCallParser`, :class:`RequiredCallsParser`, :class:`HermesParser`) map text to a
:class:`ParsedOutput`. Invariant (what streaming relies on): for a text ``t`` and any extension ``t + s``,
``parse(t, final=False)`` is a prefix of ``parse(t + s, final=...)``: its content is a prefix of the later
content, its calls are the later calls' first ones with the same names, and each call's arguments are a
prefix of the later arguments. A streamed response sends the difference between consecutive parses
(:class:`ToolCallStream`), so the client's accumulated message equals the non-streamed one. What is not yet
decided (a ``<tool_call>`` block without its end, a suffix that may start one, content that is whitespace so
far) is held back until it is.

A call cut short by ``max_tokens`` (``finish_reason`` ``length``) keeps the arguments generated so far, as
OpenAI's does; in ``required`` mode an element whose name was not complete is dropped. In ``auto`` mode the
content of an answer with calls is the text outside the blocks without its trailing whitespace (an answer without
calls keeps its text as it is); a block that is not a JSON object with a known function ``name`` and an object
``arguments`` stays in the content as text, and so do blocks beyond the first with ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kv8.engine.structured import check_grammar
from kv8.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatTool,
    FunctionDefinition,
    NamedToolChoice,
)
from kv8.options import option
from kv8.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS: tuple[str, ...] = ("hermes",)   # values of --tool-call-parser


@dataclass(frozen=True)
class ToolOptions:
    """The server's tool options (vLLM's flags). Invariant: ``enable_auto_tool_choice`` implies a parser, and the
    parser is one of :data:`TOOL_CALL_PARSERS`."""

    enable_auto_tool_choice: bool = option(
        False, 'allow tool_choice "auto" (the default when a request gives tools): the model decides whether to '
        "call tools, and --tool-call-parser reads the calls out of its text (vLLM's flag)", type=bool)
    tool_call_parser: str | None = option(
        None, "the format of the model's tool calls for tool_choice auto: hermes = <tool_call>{...}</tool_call> "
        "blocks (Hermes 2 Pro / 3, Qwen 2.5 / 3)", choices=TOOL_CALL_PARSERS)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser={self.tool_call_parser!r} is not supported; allowed: "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice requires --tool-call-parser (allowed: "
                             f"{', '.join(TOOL_CALL_PARSERS)})")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str   # JSON text of the arguments object (a prefix of it while generating, or when cut short)


@dataclass(frozen=True)
class ParsedOutput:
    content: str                     # "" when there is none
    calls: tuple[ParsedCall, ...]


class OutputParser(Protocol):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The calls and content of ``text``; with ``final`` False only what no continuation can change."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_schema(fn: FunctionDefinition) -> dict[str, Any]:
    """The JSON schema that a call's arguments must match: ``parameters`` (``type: object`` made explicit), or an
    empty object for a function without parameters."""
    if fn.parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", **fn.parameters}


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """``tool_choice: required``: a JSON array of ``{"name", "parameters"}`` objects, one branch per tool (vLLM's
    shape), at most one item unless ``parallel``. The tools' ``$defs`` are lifted to the top, where their
    ``#/$defs/...`` references point; the same name defined twice differently is a ``ValueError``."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        params = dict(arguments_schema(tool.function))
        for name, definition in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                raise ValueError(f"tools define $defs/{name} twice, differently; give shared definitions one "
                                 "schema")
            defs[name] = definition
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# a JSON string (an unterminated one runs to the end of the text), or a bracket
_JSON_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"?|[{}\[\]]')


def _object_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that starts at ``text[start]``, None if it is not complete.
    Strings are skipped by a regular expression, so a streamed answer's repeated scans stay cheap."""
    depth = 0
    for m in _JSON_PIECE.finditer(text, start):
        ch = m.group()
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return m.end()
    return None


@dataclass(frozen=True)
class NamedCallParser:
    """``tool_choice`` naming a function: the whole text is its arguments."""

    name: str

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", (ParsedCall(self.name, text),))


# one element of the required array up to its arguments: {"name": "<name>", "parameters": (names are [A-Za-z0-9_-])
_ELEMENT_HEAD = re.compile(r'\s*,?\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"parameters"\s*:\s*')


@dataclass(frozen=True)
class RequiredCallsParser:
    """``tool_choice: required``: the text is (a prefix of) the JSON array of :func:`required_schema`, whose
    grammar fixes the key order (``name`` first) and makes ``parameters`` an object."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls: list[ParsedCall] = []
        start = text.find("[")
        if start < 0:
            return ParsedOutput("", ())
        pos = start + 1
        while (m := _ELEMENT_HEAD.match(text, pos)) is not None:
            end = _object_end(text, m.end())
            calls.append(ParsedCall(m.group(1), text[m.end():end]))
            if end is None:
                break
            close = text.find("}", end)
            if close < 0:
                break
            pos = close + 1
        return ParsedOutput("", tuple(calls))


TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def _partial_start(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>`` (may still become one)."""
    for k in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return k
    return 0


@dataclass(frozen=True)
class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (vLLM's ``hermes`` parser's format).
    ``names``: the request's functions; ``max_calls``: 1 with ``parallel_tool_calls: false``, else None."""

    names: frozenset[str]
    max_calls: int | None = None

    def _call(self, body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            return None
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pieces: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            begin = text.find(TOOL_CALL_START, pos)
            if begin < 0:
                tail = text[pos:]
                pieces.append(tail if final else tail[:len(tail) - _partial_start(tail)])
                break
            pieces.append(text[pos:begin])
            body_at = begin + len(TOOL_CALL_START)
            end = text.find(TOOL_CALL_END, body_at)
            room = self.max_calls is None or len(calls) < self.max_calls
            if end < 0:   # unterminated: undecided until the text ends
                if final:
                    call = self._call(text[body_at:]) if room else None
                    if call is None:
                        pieces.append(text[begin:])
                    else:
                        calls.append(call)
                break
            call = self._call(text[body_at:end]) if room else None
            if call is None:
                pieces.append(text[begin:end + len(TOOL_CALL_END)])
            else:
                calls.append(call)
            pos = end + len(TOOL_CALL_END)
        content = "".join(pieces)
        if not final or calls:   # trailing whitespace before calls is no content; mid-stream it is undecided
            content = content.rstrip()
        return ParsedOutput(content, tuple(calls))


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools change: the grammar (``structured``, None for free text) and how its output is
    read (``parser``, None: plain content)."""

    mode: Literal["none", "auto", "required", "named"]
    structured: StructuredOutputsParams | None = None
    parser: OutputParser | None = None

    def finish_reason(self, parsed: ParsedOutput, reason: str | None) -> str | None:
        """``tool_calls`` for a finished ``required`` / ``auto`` answer that holds calls; else ``reason``."""
        if reason == "stop" and parsed.calls and self.mode in ("required", "auto"):
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed ``message`` of a finished choice and its finish reason."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, reason
        parsed = self.parser.parse(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if parsed.calls:
            message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        return message, self.finish_reason(parsed, reason)


def plan_tools(req: ChatCompletionRequest, options: ToolOptions) -> ToolPlan:
    """The :class:`ToolPlan` of a validated request; a 400 for a tool schema that cannot be compiled, or ``auto``
    on a server that does not enable it."""
    tools = req.tools or []
    for i, tool in enumerate(tools):
        try:
            check_grammar(StructuredOutputsParams(json=arguments_schema(tool.function)))
        except ValueError as e:
            raise APIError(400, f"tools[{i}].function.parameters of {tool.function.name!r} is not a usable JSON "
                                f"schema: {e}", param="tools") from e
    mode = req.tool_mode
    if mode == "none":
        return ToolPlan("none")
    if mode == "auto":
        if not options.enable_auto_tool_choice:
            raise APIError(400, '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                                f"--tool-call-parser (allowed: {', '.join(TOOL_CALL_PARSERS)}); tool_choice is "
                                '"auto" by default when tools are given: send tool_choice "required", "none" or a '
                                "named function instead", param="tool_choice")
        return ToolPlan("auto", None, HermesParser(frozenset(t.function.name for t in tools),
                                                   1 if req.parallel_tool_calls is False else None))
    if mode == "named":
        assert isinstance(req.tool_choice, NamedToolChoice)
        name = req.tool_choice.function.name
        fn = next(t.function for t in tools if t.function.name == name)
        return ToolPlan("named", StructuredOutputsParams(json=arguments_schema(fn)), NamedCallParser(name))
    try:
        spec = StructuredOutputsParams(json=required_schema(tools, req.parallel_tool_calls is not False))
        check_grammar(spec)
    except ValueError as e:
        raise APIError(400, f"tool_choice 'required': the tools' schemas cannot be combined: {e}",
                       param="tools") from e
    return ToolPlan("required", spec, RequiredCallsParser())


class ToolCallStream:
    """One streamed choice's progress: what content and which call arguments were sent. :meth:`step` returns the
    new content and the ``delta.tool_calls`` entries for a newer parse (see the module docstring's invariant): a
    call's first entry has ``index``, ``id``, ``type`` and ``function.name``, later ones ``function.arguments``
    chunks."""

    def __init__(self) -> None:
        self.content_sent = 0
        self.calls: list[tuple[str, int]] = []   # (id, characters of arguments sent)

    def step(self, parsed: ParsedOutput) -> tuple[str, list[dict[str, Any]]]:
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.calls):
                call_id = new_call_id()
                self.calls.append((call_id, len(call.arguments)))
                deltas.append({"index": i, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                continue
            call_id, sent = self.calls[i]
            if len(call.arguments) > sent:
                deltas.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
                self.calls[i] = (call_id, len(call.arguments))
        return content, deltas
