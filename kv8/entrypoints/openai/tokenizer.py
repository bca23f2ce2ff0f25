"""The server's tokenizer: its own instance, loaded from the model's files, used under a lock.

Hugging Face fast tokenizers must not be used from two threads at once: a call that borrows the Rust
tokenizer mutably (setting truncation or padding) while another thread uses it raises
``RuntimeError: Already borrowed``. The engine thread decodes with the engine's tokenizer at every step, and
the server tokenizes prompts in worker threads (so that a long prompt does not stall the event loop), so the
server never touches the engine's instance: it loads a second one, and serializes every call to it with a
lock (worker threads tokenizing, the event loop decoding prompt tokens for legacy logprobs).

Invariant: the wrapped tokenizer object is not the engine's (``ServerTokenizer.load`` reads the files again).

Token bytes (chat ``logprobs``' ``bytes``): a token may hold part of a UTF-8 character (an emoji is often four
byte tokens), which ``decode([id])`` turns into U+FFFD. :meth:`ServerTokenizer.token_bytes` returns the token's
real bytes instead, so that joining them rebuilds the text: byte-level BPE vocabularies (GPT-2's, SmolLM2's,
Llama 3's, Qwen's) spell bytes with GPT-2's printable byte alphabet, mapped back here; SentencePiece vocabularies
spell a byte ``<0xE2>`` (byte fallback) and a space ``▁``. Tokens that are neither (added special tokens) fall
back to the UTF-8 of their decoded text.

Tools: a chat template supports tools when it reads the ``tools`` variable; it renders a history's assistant tool
calls when it reads ``tool_calls``, and tool replies when it compares a role with ``"tool"``
(:func:`template_tool_support`, from the template's jinja syntax tree). A request with tools or tool messages
that its template would drop is a 400 saying that the chat template has no tool support, rather than a prompt
without them. Messages reach the template as Hugging Face templates expect them (tool call arguments as dicts).
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv8.engine.config import EngineConfig
from kv8.entrypoints.openai.protocol import APIError, ChatMessage
from kv8.loader.tokenizer import load_tokenizer


@functools.cache
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(tokenizer: Any) -> set[str]:
    """The ``type``s of a fast tokenizer's decoder (nested in ``Sequence``s), empty when it has none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return set()
    found: set[str] = set()
    stack = [decoder]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            found.add(str(d.get("type")))
            stack.extend(d.get("decoders") or [])
    return found


@dataclass(frozen=True)
class TemplateToolSupport:
    """What a chat template does with tools: reads ``tools``, renders assistant ``tool_calls``, renders tool
    replies (role ``"tool"``)."""

    reads_tools: bool
    renders_tool_calls: bool
    renders_tool_role: bool


@functools.lru_cache(maxsize=16)
def template_tool_support(source: str) -> TemplateToolSupport:
    """:class:`TemplateToolSupport` of a jinja chat template: from its syntax tree (undeclared variables, attribute
    names and string constants); from its text when jinja cannot parse it (a tag of an extension jinja lacks)."""
    import jinja2
    from jinja2 import meta, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:
        return TemplateToolSupport(bool(re.search(r"\btools\b", source)), "tool_calls" in source,
                                   bool(re.search(r"[\'\"]tool[\'\"]", source)))
    names = {n.attr for n in tree.find_all(nodes.Getattr)}
    names |= {n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)}
    return TemplateToolSupport("tools" in meta.find_undeclared_variables(tree), "tool_calls" in names,
                               "tool" in names)


def _json_value(value: Any) -> Any:
    """A tokenizer-config value as JSON: special tokens (``AddedToken``) as their text, containers item by item,
    anything else that JSON has no type for as its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    content = getattr(value, "content", None)   # tokenizers.AddedToken
    return content if isinstance(content, str) else str(value)


# init_kwargs that name a file or directory of the server (transformers records where it loaded from)
_PATH_KEYS = frozenset({"name_or_path", "pretrained_model_name_or_path", "cache_dir", "gguf_file"})
_PATH_SUFFIXES = ("_file", "_files", "_dir", "_path")


def _names_a_path(key: str, value: Any) -> bool:
    """Whether a tokenizer-config entry names a file or directory of the server: by its key (``name_or_path``,
    ``*_file``, ``*_dir`` ...), or, under any other key but a special token's (whose text may be anything), a
    string value that is an absolute path (POSIX or Windows) or starts with ``~``."""
    if key in _PATH_KEYS or key.endswith(_PATH_SUFFIXES):
        return True
    if not isinstance(value, str) or key.endswith(("_token", "_tokens")) or key == "chat_template":
        return False
    return value.startswith("~") or os.path.isabs(value) or bool(re.match(r"[A-Za-z]:[\\/]", value))


class ServerTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        types = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types or "Metaspace" in types or "Replace" in types

    @classmethod
    def load(cls, config: EngineConfig) -> ServerTokenizer:
        """A new tokenizer instance for the engine's model (the same files the engine loaded)."""
        return cls(load_tokenizer(config.model_kind, config.model))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, special tokens added as the engine adds them (``tokenizer.encode``)."""
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        with self._lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes each token stands for (see the module docstring); joined, they are the text's UTF-8."""
        with self._lock:
            tokens = self.tokenizer.convert_ids_to_tokens(list(ids))
        out = []
        for tid, token in zip(ids, tokens):
            raw = self._bytes_of(token) if isinstance(token, str) else None
            out.append(raw if raw is not None else self.decode([tid]).encode("utf-8"))
        return out

    def _bytes_of(self, token: str) -> bytes | None:
        if self._byte_level:
            decoder = gpt2_byte_decoder()
            if token and all(ch in decoder for ch in token):
                return bytes(decoder[ch] for ch in token)
            return None
        if self._byte_fallback:
            m = _SP_BYTE.fullmatch(token)
            if m:
                return bytes([int(m.group(1), 16)])
            if token.startswith("<") and token.endswith(">"):   # <s>, </s>, <unk>: special, decode them
                return None
            return token.replace("\u2581", " ").encode("utf-8")
        return None

    def info(self) -> dict[str, Any]:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's configuration (``tokenizer_config.json``'s fields as the
        tokenizer was built, special tokens as their text), ``tokenizer_class``, and the special tokens and
        ``chat_template`` that lm-evaluation-harness's remote tokenizer reads. Nothing that names a file or a
        directory of the server (:func:`_names_a_path`: ``name_or_path``, ``vocab_file``, a GGUF tokenizer's cache
        entry ...) is in it."""
        tok = self.tokenizer
        config = {k: _json_value(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
                  if not _names_a_path(k, v)}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if config.get(name) is None:
                config[name] = getattr(tok, name, None)
        config["tokenizer_class"] = type(tok).__name__
        if self.has_chat_template:
            config["chat_template"] = self.template_source(with_tools=False)
        return config

    def template_source(self, with_tools: bool) -> str:
        """The chat template's text (of a set of named templates: ``tool_use`` with tools where there is one, else
        ``default``, as transformers picks them)."""
        template = self.tokenizer.chat_template
        if isinstance(template, dict):
            if with_tools and "tool_use" in template:
                return str(template["tool_use"])
            return str(template.get("default", next(iter(template.values()))))
        return str(template)

    def apply_chat_template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation followed (by default) by the assistant's generation prompt. Raises what
        the template raises (jinja ``TemplateError`` and friends) for a conversation it does not accept."""
        with self._lock:
            ids = self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True,
                                                     add_generation_prompt=add_generation_prompt)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def chat_ids(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of validated chat ``messages`` (and ``tools``) through the chat template; a 400 when the
        tokenizer has no template, when tools or tool messages meet a template without tool support, or when the
        template rejects the messages."""
        if not self.has_chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        support = template_tool_support(self.template_source(bool(tools)))
        if tools and not support.reads_tools:
            raise APIError(400, "this model's chat template has no tool support (it does not read `tools`), so the "
                                "model would never see them; send the request without tools, or serve a model "
                                "whose chat template supports tools", param="tools")
        for i, m in enumerate(messages):
            if m.tool_calls and not support.renders_tool_calls:
                raise APIError(400, f"messages[{i}] is an assistant message with tool_calls, but this model's chat "
                                    "template has no tool support (it does not render tool_calls)", param="messages")
            if m.role == "tool" and not support.renders_tool_role:
                raise APIError(400, f"messages[{i}] has role 'tool', but this model's chat template has no tool "
                                    "support (it does not render tool messages)", param="messages")
        conv = [m.template_dict() for m in messages]
        try:
            return self.apply_chat_template(conv, add_generation_prompt, tools)
        except Exception as e:  # jinja TemplateError and friends: the conversation does not fit the template
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
