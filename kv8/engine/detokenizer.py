"""Incremental detokenization and stop-string search (used by :mod:`kv8.engine.output_processor`).

Text is produced a token at a time without re-decoding the whole output: decode a short window of ids twice
(with and without the newest ones) and emit the difference, holding back text that ends in an incomplete
UTF-8 sequence (U+FFFD) until the next token completes it.

The windows are decoded by the ``tokenizers`` library's own ``decode`` where that is what the tokenizer's
``decode`` returns for a list of ids (:func:`backend_decode`): transformers' Python around it (argument
conversion, batch checks) cost more than the decode itself, twice per request and token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The ``tokenizers`` decode (``ids, skip_special_tokens=``) that returns exactly ``tokenizer.decode``'s text
    for a list of ids, or None where that is not known: a transformers fast tokenizer whose class keeps
    ``PreTrainedTokenizerFast``'s ``decode`` and ``_decode`` (that ``_decode`` is the backend's decode, then the
    optional clean-up of tokenization spaces) and has that clean-up off."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:   # pragma: no cover - transformers is a dependency
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or cls.decode is not PreTrainedTokenizerFast.decode
            or cls._decode is not PreTrainedTokenizerFast._decode or tokenizer.clean_up_tokenization_spaces):
        return None
    decode: Callable[..., str] = tokenizer.backend_tokenizer.decode
    return decode


class IncrementalDetokenizer:
    """One request's text, a token at a time. ``decode``: :func:`backend_decode`'s function for ``tokenizer``
    where the caller has it (found once per tokenizer), else ``tokenizer.decode`` is used; both give the same
    text."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, decode: Callable[..., str] | None = None) -> None:
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = decode if decode is not None else tokenizer.decode
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end), emitted when the request finishes."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last ``new_len`` characters of ``text``: (index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
