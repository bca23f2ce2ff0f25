"""Structured output: grammars from :class:`StructuredOutputsParams`, one matcher per request, masks on logits.

A request whose ``SamplingParams.structured_outputs`` is set may only produce text its grammar accepts (a JSON
schema, any JSON object, a regular expression, one of a list of strings, or a Lark grammar). Each step, for
the rows of the batch that have a matcher, the matcher's allowed-token set (a bitmask, 32 tokens per int32)
sets every other logit to -inf before sampling; the other rows are not touched (bit-identical). End-of-
sequence tokens are allowed exactly when the grammar accepts what was generated. After a token is sampled the
scheduler advances the request's matcher (:meth:`GrammarMatcher.accept`). A preempted request keeps its output
tokens and so keeps its matcher as it is: the recomputed step samples the token that follows them.

Library: llguidance (Rust, 7.6 MB wheel, no dependencies). Measured on this shared 2-core CPU (one thread, a
~35-token JSON document, ``benchmarks/bench_structured.py``, numbers vary 2x with load): mask computation 15-200
us/token with SmolLM2's 49k vocabulary (fill + apply 190-400) and 70-560 us/token with Gemma 3's 262k (fill +
apply about 1 ms); xgrammar computed the same masks in 9-13 and 22-190 us/token, but it depends on triton (about
1 GB installed on Linux x86-64) and takes 3 s to import. Decoding SmolLM2 (batch 4, 15 ms/token) with a schema
cost no measurable time over unconstrained decoding. The bitmask is applied here with plain torch ops (llguidance's own
``llguidance.torch`` module is not used: it applies ``torch.compile`` when imported).

JSON is compact (``whitespace_flexible: false``: ``,`` and ``:`` separators, no free whitespace), so a
small model cannot loop on newlines inside a JSON value.

Grammar errors (an invalid schema or regex) raise ``ValueError`` naming ``structured_outputs``;
:func:`check_grammar` needs no tokenizer, so the server can answer 400 before a request reaches the engine.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import torch

from kv8.sampling_params import StructuredOutputsParams

__all__ = ["GrammarCompiler", "GrammarMatcher", "apply_grammar_masks", "check_grammar", "grammar_source"]


# compact JSON: no free whitespace, llguidance's default separators (", " and ": ")
_JSON_OPTIONS: Any = {"whitespace_flexible": False}   # llguidance.JsonCompileOptions


def _escape_lark(text: str) -> str:
    """A Lark string literal for ``text`` (JSON string escapes are valid Lark escapes)."""
    return json.dumps(text)


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON grammar format) for ``spec``; does not validate it."""
    import llguidance

    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=_JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_escape_lark(c) for c in spec.choice))
    assert spec.grammar is not None   # StructuredOutputsParams holds exactly one of them
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


@functools.lru_cache(maxsize=256)
def _checked_source(spec: StructuredOutputsParams) -> str:
    import llguidance

    try:
        source = grammar_source(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs: {spec.kind} is not a usable grammar: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(source)
    if error:
        raise ValueError(f"structured_outputs: {spec.kind} is not a usable grammar: {error.strip()}")
    return source


def check_grammar(spec: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` (naming ``structured_outputs``) when ``spec`` cannot be compiled; no tokenizer needed."""
    _checked_source(spec)


class GrammarMatcher:
    """Where one request stands in its grammar. Invariant: it has consumed exactly the request's output tokens
    (the scheduler calls :meth:`accept` for each appended token)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 ``[B, ceil(V / 32)]``, bit ``t % 32`` of
        word ``t // 32`` set when token ``t`` is allowed)."""
        # what llguidance.torch.fill_next_token_bitmask does; that module is not imported: it applies
        # torch.compile at import time, which imports triton where it is installed (3 s)
        if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.device.type != "cpu":
            raise ValueError("bitmask must be a contiguous int32 CPU tensor [B, ceil(V / 32)]")
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it (the matcher is then in error)."""
        return bool(self._m.consume_token(token_id))

    @property
    def error(self) -> str:
        return str(self._m.get_error() or "")

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS is allowed now)."""
        return bool(self._m.is_accepting())


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer into matchers. The llguidance tokenizer (about
    0.7 s for a 49k vocabulary, 9 s for 262k) is built on the first structured request, not at engine start."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self._eos or None)
        return self._ll_tokenizer

    def check(self, spec: StructuredOutputsParams) -> None:
        """``ValueError`` naming ``structured_outputs`` when ``spec`` cannot be compiled."""
        check_grammar(spec)

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar (``spec`` must pass :meth:`check`)."""
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer(), _checked_source(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs: {spec.kind} is not a usable grammar: {m.get_error()}")
        return GrammarMatcher(m)


# bit j of byte b, for every byte value: one lookup turns the mask's bytes into 8 bools each
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()   # [256, 8]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``bitmask`` int32 ``[R, W]`` -> bool ``[R, vocab]``, True where a token is allowed. Byte ``k`` of word ``w``
    (little-endian, as on x86-64 and ARM) holds tokens ``32 w + 8 k .. 32 w + 8 k + 7``."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()                        # [R, 4W]
    return _BYTE_BITS[as_bytes].reshape(bitmask.shape[0], -1)[:, :vocab]           # [R, V]


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
    """Set to -inf, in place, the logits of ``logits [S, V]`` that row ``i``'s matcher does not allow; rows whose
    matcher is None are not touched."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)   # [R, W]
    for j, i in enumerate(rows):
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_bitmask(bitmask, j)
    banned = ~unpack_bitmask(bitmask, vocab).to(logits.device)                  # [R, V]
    for j, i in enumerate(rows):
        logits[i].masked_fill_(banned[j], float("-inf"))
