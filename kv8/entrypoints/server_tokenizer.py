"""The server's tokenizer: its own instance, loaded from the model's files, used under a lock.

Hugging Face fast tokenizers must not be used from two threads at once: a call that borrows the Rust
tokenizer mutably (setting truncation or padding) while another thread uses it raises
``RuntimeError: Already borrowed``. The engine thread decodes with the engine's tokenizer at every step, and
the server tokenizes prompts in worker threads (so that a long prompt does not stall the event loop), so the
server never touches the engine's instance: it loads a second one, and serializes every call to it with a
lock (worker threads tokenizing, the event loop decoding prompt tokens for legacy logprobs).

Invariant: the wrapped tokenizer object is not the engine's (``ServerTokenizer.load`` reads the files again).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kv8.config import EngineConfig
from kv8.entrypoints.protocol import APIError, ChatMessage
from kv8.model.tokenizer import load_tokenizer


class ServerTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

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
