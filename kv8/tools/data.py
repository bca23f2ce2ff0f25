"""Text for calibration and evaluation: read documents from files, cut token windows.

Accepted files (``.bz2`` compression of any of them is undone first, by suffix):

* ``*.jsonl``: one JSON object per line with a string ``"text"`` field (blank lines are skipped);
* a MediaWiki XML dump (detected by content: the text starts with ``<mediawiki``), e.g. the gensim test
  fragment of English Wikipedia: the ``<text>`` of every main-namespace, non-redirect page, with the wiki
  markup reduced to plain prose by :func:`wiki_to_text`;
* anything else: plain UTF-8 text, one document.

Every problem (missing or unreadable file, bad compression, bad JSON, no text at all) raises ValueError
naming the file. Token windows are consecutive, non-overlapping slices of the concatenated documents
(joined by a blank line), tokenized without special tokens.
"""

from __future__ import annotations

import bz2
import json
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any

from kv8.validators import check_int

__all__ = ["read_corpus", "read_documents", "require_bos", "start_with_bos", "tokenize_corpus", "token_windows",
           "wiki_to_text"]


def _read_bytes(path: str) -> tuple[bytes, str]:
    """(decompressed bytes, the file name without a ``.bz2`` suffix)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"data file {path!r} cannot be read: {e.strerror or e}") from None
    name = os.path.basename(path)
    if name.lower().endswith(".bz2"):
        try:
            raw = bz2.decompress(raw)
        except (OSError, ValueError) as e:
            raise ValueError(f"data file {path!r} ends in .bz2 but is not valid bzip2 data: {e}") from None
        name = name[:-4]
    return raw, name


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove every balanced ``open_ ... close`` span (nesting allowed); an unclosed opener is dropped."""
    out: list[str] = []
    depth, i = 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth += 1
            i += len(open_)
        elif depth and text.startswith(close, i):
            depth -= 1
            i += len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]",
                        re.IGNORECASE)
_EXT_LINK = re.compile(r"\[(?:https?|ftp)://[^\s\]]+\s*([^\]]*)\]")
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.DOTALL | re.IGNORECASE)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.MULTILINE)
_EMPHASIS = re.compile(r"'{2,}")
_LIST = re.compile(r"^[*#:;]+\s*", re.MULTILINE)
_BLANKS = re.compile(r"\n{3,}")


def wiki_to_text(markup: str) -> str:
    """Plain prose from MediaWiki markup: templates, tables, references, comments, file/category links
    and HTML tags removed; ``[[target|label]]`` becomes ``label``, external links their label; headings
    and list items keep their words. Good enough for language-model statistics, not a full parser."""
    text = _COMMENT.sub("", markup)
    text = _REF.sub("", text)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    text = _FILE_LINK.sub("", text)
    text = _LINK.sub(r"\1", text)
    text = _EXT_LINK.sub(r"\1", text)
    text = _TAG.sub("", text)
    text = _HEADING.sub(r"\1", text)
    text = _EMPHASIS.sub("", text)
    text = _LIST.sub("", text)
    return _BLANKS.sub("\n\n", text).strip()


def _wiki_documents(raw: bytes, path: str) -> list[str]:
    docs: list[str] = []
    try:
        root = ET.fromstring(raw)
    except ET.ParseError as e:
        raise ValueError(f"data file {path!r} looks like a MediaWiki XML dump but does not parse: {e}") from None
    ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    for page in root.iter(f"{ns}page"):
        if (page.findtext(f"{ns}ns") or "0") != "0" or page.find(f"{ns}redirect") is not None:
            continue
        markup = page.findtext(f"{ns}revision/{ns}text") or ""
        if markup.lstrip().upper().startswith("#REDIRECT"):
            continue
        text = wiki_to_text(markup)
        if text:
            docs.append(text)
    return docs


def _jsonl_documents(raw: bytes, path: str) -> list[str]:
    docs: list[str] = []
    for number, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"data file {path!r} line {number} is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f"data file {path!r} line {number}: expected an object with a string 'text' field, "
                             f"got {str(obj)[:80]!r}")
        if obj["text"].strip():
            docs.append(obj["text"])
    return docs


def read_documents(path: str) -> list[str]:
    """The non-empty documents of one data file (see the module docstring for the formats)."""
    raw, name = _read_bytes(path)
    try:
        if name.lower().endswith(".jsonl"):
            docs = _jsonl_documents(raw, path)
        elif raw.lstrip()[:10].startswith(b"<mediawiki"):
            docs = _wiki_documents(raw, path)
        else:
            text = raw.decode("utf-8")
            docs = [text] if text.strip() else []
    except UnicodeDecodeError as e:
        raise ValueError(f"data file {path!r} is not UTF-8 text: {e}") from None
    if not docs:
        raise ValueError(f"data file {path!r} holds no text (empty, or no documents with text)")
    return docs


def read_corpus(paths: Sequence[str]) -> list[str]:
    """The documents of every file in ``paths``, in order (read before any model is loaded, to fail fast)."""
    if not paths:
        raise ValueError("no data files given; pass at least one with --data")
    return [doc for path in paths for doc in read_documents(path)]


def tokenize_corpus(docs: Sequence[str], tokenizer: Any) -> list[int]:
    """``docs`` joined by blank lines, tokenized without special tokens."""
    return list(tokenizer("\n\n".join(docs), add_special_tokens=False)["input_ids"])


def require_bos(bos_token_id: int | None) -> int:
    """The BOS token ``--add-bos`` puts first (the model config's ``bos_token_id``), checked before any model is
    loaded: ValueError naming the flag when the model has none."""
    if bos_token_id is None:
        raise ValueError("--add-bos: the model's config names no BOS token (bos_token_id is not set); leave --add-bos "
                         "out")
    return bos_token_id


def start_with_bos(windows: Sequence[Sequence[int]], bos_token_id: int) -> list[list[int]]:
    """``windows`` with each one's first token replaced by the BOS token (``--add-bos``; what llama-perplexity does to
    each chunk of a model whose tokenizer adds BOS), so that every window starts as a request with BOS does and keeps
    its length."""
    return [[bos_token_id, *w[1:]] for w in windows]


def token_windows(tokens: Sequence[int], length: int, count: int | None, skip: int = 0,
                  option: str = "length", skipped: str = "") -> list[list[int]]:
    """Up to ``count`` (None: all) consecutive windows of exactly ``length`` tokens, starting at token
    ``skip``. Raises ValueError when not even one window fits, naming ``option`` (the flag that set ``length``,
    e.g. ``--window``) and what ``skipped`` (e.g. ``--skip-tokens``) so that the user knows what to change."""
    check_int("window length", length, 2)
    check_int("skip", skip, 0)
    check_int("count", count, 1, optional=True)
    available = (len(tokens) - skip) // length
    if available < 1:
        why = f" ({skipped})" if skipped and skip else ""
        raise ValueError(f"the data has {len(tokens)} tokens; after skipping {skip}{why} not even one window of "
                         f"{option} {length} tokens fits; give more text (--data) or a smaller {option}")
    n = available if count is None else min(count, available)
    return [list(tokens[skip + i * length: skip + (i + 1) * length]) for i in range(n)]
