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
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

from kv8.config import EngineConfig
from kv8.entrypoints.protocol import APIError, ChatMessage
from kv8.model.tokenizer import load_tokenizer


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

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation followed (by default) by the assistant's generation prompt. Raises what
        the template raises (jinja ``TemplateError`` and friends) for a conversation it does not accept."""
        with self._lock:
            ids = self.tokenizer.apply_chat_template(conversation, tokenize=True,
                                                     add_generation_prompt=add_generation_prompt)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def chat_ids(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of validated chat ``messages`` through the chat template; a 400 naming ``messages`` when the
        tokenizer has no template or the template rejects them."""
        if not self.has_chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        conv = [{"role": m.template_role, "content": m.text()} for m in messages]
        try:
            return self.apply_chat_template(conv, add_generation_prompt)
        except Exception as e:  # jinja TemplateError and friends: the conversation does not fit the template
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
