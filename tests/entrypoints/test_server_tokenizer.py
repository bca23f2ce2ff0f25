"""The tokenizer routes of a real ``kv8 serve`` (the ``server`` fixture of tests/entrypoints/conftest.py):
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` against the model's own tokenizer; and the server tokenizer's
token bytes (:class:`kv8.entrypoints.openai.tokenizer.ServerTokenizer`), byte-level and SentencePiece.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from tests.helpers.server import API_KEY, Server, expect_error, post

TEXTS_BEYOND_ASCII = ["héllo wörld", "😀 emoji 🎉", "中文字符", "привет, мир", "naïve café — ok"]


def test_token_bytes_rebuild_the_text_byte_level_and_sentencepiece(tiny_llama: str) -> None:
    """Tokens holding part of a UTF-8 character give their real bytes (not U+FFFD's), for byte-level BPE (GPT-2's
    alphabet) and SentencePiece byte fallback (<0xE2>): joined, they are the text's UTF-8."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from kv8.entrypoints.openai.tokenizer import ServerTokenizer

    byte_level = ServerTokenizer(AutoTokenizer.from_pretrained(tiny_llama))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", *"abcdefghijklmnopqrstuvwxyz,.—", "\u2581o", "\u2581ok", "ll"]:
        vocab.setdefault(piece, len(vocab))
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "o"), ("\u2581o", "k"), ("l", "l")],
                              byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sentencepiece = ServerTokenizer(PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>",
                                                            unk_token="<unk>"))
    for tok, lead in ((byte_level, ""), (sentencepiece, " ")):
        for text in TEXTS_BEYOND_ASCII:
            ids = tok.encode(text, add_special_tokens=False)
            parts = tok.token_bytes(ids)
            assert b"".join(parts) == (lead + text).encode("utf-8"), (text, ids, parts)
            if len(text.encode()) > len(text):   # some token is part of a character: not U+FFFD's bytes
                assert all(p != "\ufffd".encode() for p in parts)
    assert sentencepiece.token_bytes([vocab["<0xE2>"], 1]) == [b"\xe2", b"<s>"]


def test_tokenize_and_detokenize_endpoints(server: Server, tiny_llama: str) -> None:
    """vLLM's /tokenize and /detokenize: the ids generation sees for a prompt or a chat, and text back."""
    from kv8.loader.tokenizer import load_tokenizer

    oracle = load_tokenizer("hf", tiny_llama)
    resp = post(server, "/tokenize", {"model": tiny_llama, "prompt": "Hello there"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == oracle.encode("Hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256
    plain = post(server, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False}).json()["tokens"]
    assert plain == oracle.encode("Hello there", add_special_tokens=False)
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    assert chat == list(oracle.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"])
    back = post(server, "/detokenize", {"model": tiny_llama, "tokens": plain})
    assert back.status_code == 200 and back.json()["prompt"] == oracle.decode(plain)
    expect_error(post(server, "/detokenize", {"tokens": [0, 999999]}), 400, "vocabulary", param="tokens")
    expect_error(post(server, "/tokenize", {"prompt": "a", "messages": msgs}), 400, "exactly one")
    expect_error(post(server, "/tokenize", {"prompt": "a", "model": "other"}), 404, "does not exist")
    expect_error(post(server, "/tokenize", {"prompt": "a"}, key=None), 401, "API key")


def test_tokenizer_info_serves_lm_eval_remote_tokenizer(server: Server, tiny_llama: str) -> None:
    """vLLM's GET /tokenizer_info, used the way lm-evaluation-harness's ``tokenizer_backend=remote`` uses it: the
    special tokens' text, whose /tokenize (no special tokens added) gives their ids, and the chat template, which
    its own jinja renders to the text the model's tokenizer makes; behind the API key like every other route."""
    import jinja2
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(tiny_llama)
    assert httpx.get(server.url + "/tokenizer_info", timeout=10).status_code == 401
    resp = httpx.get(server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["tokenizer_class"] == type(oracle).__name__
    assert (info["eos_token"], info["bos_token"]) == (oracle.eos_token, oracle.bos_token)
    assert "vocab_file" not in info and "merges_file" not in info
    eos_ids = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos_ids == [oracle.eos_token_id]
    msgs = [{"role": "user", "content": "Hello there"}]
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(messages=msgs,
                                                                              add_generation_prompt=True)
    assert rendered == oracle.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def _paths_in(text: str, paths: list[str]) -> list[str]:
    """The ``paths`` (as written, resolved, and JSON-escaped) that occur in ``text``, and any JSON string in it that
    starts like an absolute path (``"/``, ``"~``, ``"C:\\``)."""
    found = []
    for path in paths:
        for form in {path, os.path.realpath(path)}:
            if form in text or json.dumps(form)[1:-1] in text:
                found.append(form)
    found += re.findall(r'"(?:/|~|[A-Za-z]:\\\\)[^"]*"', text)
    return found


def test_tokenizer_info_names_no_path_of_the_server(server: Server, tiny_llama: str) -> None:
    """Issue 42, item 3: /tokenizer_info's whole text holds neither the model's directory, nor kv8's cache
    directory, nor the home directory, nor any other absolute path (transformers records ``name_or_path``)."""
    resp = httpx.get(server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert resp.status_code == 200, resp.text
    assert "name_or_path" not in resp.json()
    cache = os.environ.get("KV8_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kv8")
    assert _paths_in(resp.text, [tiny_llama, os.path.dirname(tiny_llama), cache, os.path.expanduser("~")]) == []


def test_tokenizer_info_of_a_gguf_model_names_no_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF model's tokenizer is read from kv8's cache (``<cache>/tokenizers/<entry>``): its info names neither
    that entry nor the GGUF file."""
    from kv8.entrypoints.openai.tokenizer import ServerTokenizer
    from kv8.loader.sources import default_model_path
    from kv8.loader.tokenizer import load_tokenizer

    cache = tmp_path / "kv8-cache"
    monkeypatch.setenv("KV8_CACHE_DIR", str(cache))
    gguf = default_model_path()
    tokenizer = ServerTokenizer(load_tokenizer("gguf", gguf))
    assert str(cache) in str(tokenizer.tokenizer.init_kwargs.get("name_or_path"))   # what transformers records
    info = tokenizer.info()
    text = json.dumps(info)
    assert info["eos_token"] and info["chat_template"]
    assert _paths_in(text, [str(cache), gguf, os.path.dirname(gguf), os.path.expanduser("~")]) == []
