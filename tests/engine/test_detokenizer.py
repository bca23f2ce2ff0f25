"""Incremental detokenization through the ``tokenizers`` library's decode (:func:`backend_decode`) gives the text the
tokenizer's own ``decode`` gives, token by token, held-back characters and special tokens included; tokenizers whose
``decode`` may differ from the backend's keep their own."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from kv8.engine.detokenizer import IncrementalDetokenizer, backend_decode

# multi-byte characters (split over several byte-level tokens), spaces, digits and punctuation
TEXT = "Ünïcödé → 東京 ✓ the capital of France; 1000 ( ) ! émigré"


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, then the flushed rest as a last element."""
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_streams_the_tokenizers_own_text(tiny_llama: str, skip_special_tokens: bool) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    fast = backend_decode(tok)
    assert fast is not None
    rng = random.Random(0)
    special = [tok.bos_token_id, tok.eos_token_id, tok.unk_token_id]
    cases = [tok.encode(TEXT, add_special_tokens=False)]
    cases += [[rng.randrange(len(tok)) for _ in range(60)] for _ in range(20)]   # any ids, specials among them
    cases += [cases[0][:7] + special + cases[0][7:]]
    for ids in cases:
        mine = stream(IncrementalDetokenizer(tok, skip_special_tokens, fast), ids)
        theirs = stream(IncrementalDetokenizer(tok, skip_special_tokens), ids)
        assert mine == theirs
        assert "".join(mine) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    held = stream(IncrementalDetokenizer(tok, skip_special_tokens, fast), cases[0])
    assert "" in held[:-1]   # a character split over tokens is held back until its last byte


def test_backend_decode_only_where_it_equals_decode(tiny_llama: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.clean_up_tokenization_spaces = True     # transformers' clean-up after the backend's decode: not the same text
    assert backend_decode(tok) is None

    class Overridden(type(tok)):  # type: ignore[misc]
        def _decode(self, *args, **kwargs):   # a subclass's own decoding
            return "x"

    tok2 = AutoTokenizer.from_pretrained(tiny_llama)
    tok2.__class__ = Overridden
    assert backend_decode(tok2) is None

    class Plain:   # not a transformers tokenizer: its decode is used
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(97 + i) for i in ids)

    assert backend_decode(Plain()) is None
    assert stream(IncrementalDetokenizer(Plain(), True), [0, 1, 2]) == ["a", "b", "c", ""]
