"""OpenAI request bodies (validated strictly) and OpenAI-shaped errors.

Every request model forbids unknown fields and validates in pydantic's strict mode: ``"1"`` is not an int,
``true`` is not a number, and a field the server does not implement is a 400, never silently ignored.
``null`` means "the default" for optional fields, as in OpenAI's API. Checks that span fields raise
:class:`FieldError`, so that the 400 still names a ``param``.

Errors leave the server as ``{"error": {"message", "type", "param", "code"}}`` (:meth:`APIError.body`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered to the client with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}   # extra response headers (Retry-After ...)
        self.request_id = request_id   # the id of the request it ends, once it has one (the X-Request-Id header)

    def response_headers(self) -> dict[str, str]:
        """The headers of the error's response: ``headers``, and ``X-Request-Id`` (the openai client's
        ``error.request_id``) once the request had an id."""
        return {**self.headers, **({"X-Request-Id": self.request_id} if self.request_id else {})}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class FieldError(ValueError):
    """A validation error raised by a model validator that belongs to field ``param`` (reported as the 400's
    ``param``; pydantic would otherwise report the whole body)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


LOGIT_BIAS_LIMIT = 100.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


StrictModel = _Strict   # the base of every request model (other routes' modules build theirs on it)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormatText(_Strict):
    """``response_format`` plain text: the default, a no-op."""

    type: Literal["text"]


class ResponseFormatJSONObject(_Strict):
    """Any JSON object (constrained decoding, :mod:`kv8.engine.structured`)."""

    type: Literal["json_object"]


class JSONSchemaSpec(_Strict):
    """OpenAI's ``json_schema`` object. ``strict`` is accepted either way: the output always matches the schema."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormatJSONSchema(_Strict):
    """Output matching a JSON schema (constrained decoding)."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]


class _SamplingFields(_Strict):
    """Fields shared by both endpoints (vLLM's extensions included: top_k, min_p, min_tokens ...)."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)          # vLLM's extension
    logit_bias: dict[str, float] | None = None                        # token id (as a JSON key) -> bias
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    # Metadata that popular clients (the openai SDK, LangChain, LiteLLM) send by default. Accepted and ignored:
    # none of them changes what is generated. Everything else unknown is still a 400.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop has {len(stops)} entries; at most {MAX_STOP_STRINGS} are allowed")
        if any(s == "" for s in stops):
            raise FieldError("stop", "stop must not contain empty strings")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise FieldError("logit_bias", f"logit_bias keys must be token ids (decimal integers >= 0), "
                                               f"got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise FieldError("logit_bias", f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, "
                                               f"{LOGIT_BIAS_LIMIT:g}], got {bias!r} for token {key}")
        return self

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (keys were checked to be decimal integers)."""
        return None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``max_tokens=0`` (with ``echo``) scores the prompt without generating."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, str) and p == "":
            raise FieldError("prompt", "prompt is empty")
        if isinstance(p, list):
            if not p:
                raise FieldError("prompt", "prompt is an empty list")
            for i, item in enumerate(p):
                if item == "" or item == []:
                    raise FieldError("prompt", f"prompt[{i}] is empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"   # OpenAI's rule for function names


class FunctionDefinition(_Strict):
    """A function the model may call. ``parameters`` is a JSON schema of the arguments object (``type`` must be
    ``"object"`` where given, as OpenAI requires); omitted, the function takes no arguments. ``strict`` is accepted
    either way: constrained tool calls always match the schema."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_parameters(self) -> FunctionDefinition:
        kind = (self.parameters or {}).get("type", "object")
        if kind != "object":
            raise ValueError(f"the parameters of function {self.name!r} must be a JSON schema of type 'object' "
                             f"(the arguments object), got type {kind!r}")
        return self


class ChatTool(_Strict):
    """An entry of ``tools``: OpenAI's function tool."""

    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape, unset optional fields left out)."""
        f = self.function
        fn: dict[str, Any] = {"name": f.name}
        if f.description is not None:
            fn["description"] = f.description
        if f.parameters is not None:
            fn["parameters"] = f.parameters
        return {"type": "function", "function": fn}


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: the model must call it (arguments constrained to its schema)."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def lone_surrogate_path(obj: Any) -> str | None:
    """The path (``prompt[1]``, ``messages[0].content``) of a string in a JSON value that holds a lone surrogate
    (``"\\ud800"`` is valid JSON but no character; no tokenizer or UTF-8 encoder takes it), in a value or in an
    object key, else None. The path itself is valid UTF-8 (a key's surrogates written as ``\\udXXX``).
    Iterative, so nesting depth is no limit."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                # the path goes into the error (JSON, UTF-8): a key's own lone surrogate is written as \udXXX
                name = key.encode("utf-8", "backslashreplace").decode("utf-8")
                where = f"{path}.{name}" if path else name
                stack.append((key, where))
                stack.append((item, where))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def check_call_arguments(name: str, arguments: str, field: str = "function.arguments") -> None:
    """A ``ValueError`` unless a call's ``arguments`` (``field``) are a JSON object encoded as a string, without
    lone surrogates (OpenAI's shape of an earlier call's arguments)."""
    try:
        value = json.loads(arguments, parse_constant=_refuse_constant)
    except ValueError as e:
        raise ValueError(f"{field} of a call to {name!r} is not valid JSON ({e}); it must be a JSON object encoded "
                         "as a string") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field} of a call to {name!r} must be a JSON object encoded as a string, got a JSON "
                         f"{type(value).__name__}")
    bad = lone_surrogate_path(value)
    if bad is not None:
        raise ValueError(f"{field} of a call to {name!r} holds a lone UTF-16 surrogate escape (in "
                         f"{bad or 'the object'}), which is not a character; send text as valid Unicode")


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1)
    arguments: str   # a JSON object, encoded as a string (OpenAI's shape)

    @model_validator(mode="after")
    def _check_arguments(self) -> ToolCallFunction:
        check_call_arguments(self.name, self.arguments)
        return self

    def arguments_dict(self) -> dict[str, Any]:
        """The arguments parsed (a dict: checked at validation), as chat templates expect them."""
        value: dict[str, Any] = json.loads(self.arguments)
        return value


class ToolCall(_Strict):
    """A call made by an earlier assistant turn (in the history)."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Strict):
    """A message; ``developer`` is OpenAI's newer name for ``system`` and is rendered as ``system``; ``name``
    (a participant name) is accepted and not rendered, as chat templates do not read it.

    Invariants (checked here): system, developer, user and tool messages have ``content``; an assistant message
    has ``content`` or ``tool_calls`` (or both; ``tool_calls`` non-empty, with distinct ids); a tool message has a
    ``tool_call_id`` and no other message does; only assistant messages carry ``tool_calls``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> ChatMessage:
        role = self.role
        if self.tool_calls is not None and role != "assistant":
            raise ValueError(f"a {role} message cannot have tool_calls; only assistant messages do")
        if self.tool_calls is not None:
            if not self.tool_calls:
                raise ValueError("tool_calls is an empty list; omit it for an assistant message without calls")
            ids = [c.id for c in self.tool_calls]
            if len(set(ids)) != len(ids):
                raise ValueError(f"tool_calls ids must be distinct within a message, got {ids}")
        if (self.tool_call_id is not None) != (role == "tool"):
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)" if role == "tool"
                             else f"a {role} message cannot have tool_call_id; only tool messages do")
        if self.content is None and not (role == "assistant" and self.tool_calls):
            raise ValueError(f"a {role} message needs content" + (" or tool_calls" if role == "assistant" else ""))
        return self

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates read it: ``content`` as text (None for an assistant turn that
        only calls tools), tool calls with their arguments as dicts, and a tool reply's ``tool_call_id``."""
        out: dict[str, Any] = {"role": self.template_role,
                               "content": None if self.content is None else self.text()}
        if self.tool_calls is not None:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments_dict()}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def refuse_non_text_parts(items: Any, field: str, text_types: tuple[str, ...] = ("text",),
                          key: str = "content") -> None:
    """A :class:`FieldError` naming the first content part of the raw ``items`` (a request's ``field``, before
    validation; each item's parts under ``key``) whose ``type`` is not text (``image_url``, ``input_audio``,
    ``file`` ...): kv8 serves text-only models, and the 400 says so instead of listing why the part matches no
    text shape. ``param`` points at the part (``messages.0.content.1``)."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        content = item.get(key) if isinstance(item, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in text_types:
                where = f"{field}.{i}.{key}.{j}"
                raise FieldError(where, f"this server serves a text-only model: content part type {kind!r} is not "
                                        f"supported (at {where}); send text parts "
                                        f"({' or '.join(map(repr, text_types))}) or a string")


def check_tool_replies(messages: list[ChatMessage]) -> None:
    """Every tool message answers a call made by an earlier assistant message (OpenAI's rule); FieldError else."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls:
            called.update(c.id for c in m.tool_calls)
        if m.role == "tool" and m.tool_call_id not in called:
            raise FieldError("messages", f"messages[{i}] is a tool message answering tool_call_id "
                                         f"{m.tool_call_id!r}, which no earlier assistant message called "
                                         f"(called: {sorted(called) or 'none'})")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions.

    Tools: ``tools`` (at least one, distinct names) and ``tool_choice``: ``"none"``, ``"auto"`` (the default when
    tools are given, as in OpenAI's API), ``"required"`` or a named function (which must be in ``tools``). A
    ``tool_choice`` other than ``"none"`` needs ``tools``, and cannot be combined with a JSON ``response_format``
    (both would constrain the same output). ``parallel_tool_calls`` false allows at most one call."""

    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text"]] | None = None       # metadata: text is all kv8 produces

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        refuse_non_text_parts(data.get("messages") if isinstance(data, dict) else None, "messages")
        return data
    tools: list[ChatTool] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise FieldError("max_completion_tokens", f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                             f"({self.max_completion_tokens}) disagree; give one of them")
        check_tool_replies(self.messages)
        names = [t.function.name for t in self.tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise FieldError("tools", f"tools has more than one function named {', '.join(map(repr, twice))}; "
                                      "function names must be distinct")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            shown = choice if isinstance(choice, str) else choice.model_dump()
            raise FieldError("tool_choice", f"tool_choice {shown!r} requires tools; give the functions in tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not "
                                            f"in tools (functions: {', '.join(map(repr, names))})")
        fmt = self.response_format
        if self.tool_mode != "none" and fmt is not None and fmt.type != "text":
            raise FieldError("response_format", f"response_format {fmt.type!r} cannot be combined with tools and "
                                                f"tool_choice {self.tool_mode!r}: both would constrain the same "
                                                "output; drop one, or set tool_choice to 'none'")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How tools are used: ``tool_choice`` with OpenAI's default (``auto`` with tools, ``none`` without)."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return "none"
        if choice is None or choice == "auto":
            return "auto"
        return "required" if choice == "required" else "named"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """``tools`` as plain dicts (what chat templates read), None without tools."""
        return None if self.tools is None else [t.template_dict() for t in self.tools]


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a ``prompt`` (text) or chat ``messages``, exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = Field(None, min_length=1)   # rendered by the chat template with messages
    add_special_tokens: bool = True          # prompt: the tokenizer's special tokens (BOS ...), as generation adds
    add_generation_prompt: bool = True       # messages: end with the assistant's turn, as chat completions do

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        refuse_non_text_parts(data.get("messages") if isinstance(data, dict) else None, "messages")
        return data

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise FieldError("messages", "messages is empty")
        if self.tools is not None and self.messages is None:
            raise FieldError("tools", "tools is only allowed with messages")
        check_tool_replies(self.messages or [])
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.template_dict() for t in self.tools]


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


def validation_error(e: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming the field, the problem and the bad value."""
    err = e.errors(include_url=False)[0]
    loc = [str(x) for x in err["loc"]]
    where = ".".join(loc) if loc else "body"
    msg = err["msg"].removeprefix("Value error, ")
    value = repr(err.get("input"))
    if len(value) > 120:
        value = value[:117] + "..."
    extra = f"; {len(e.errors())} problems in all" if len(e.errors()) > 1 else ""
    text = f"{where}: {msg}" if err["type"] == "value_error" and not loc else f"{where}: {msg} (got {value}){extra}"
    if err["type"] == "extra_forbidden":
        text = f"unknown or unsupported field {where!r} (got {value})"
    param = loc[0] if loc else None
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        param = cause.param
        if not loc:   # a check of the whole body: its message and param name the field
            text = msg
    return APIError(400, text, param=param)
