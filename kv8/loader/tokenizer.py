"""Loading the tokenizer of a model: a Hugging Face fast tokenizer, from a model directory or a GGUF file.

For a GGUF file the tokenizer is built by transformers from the file's ``tokenizer.ggml.*`` metadata
(vocabulary, merges, token types, bos/eos/unk/pad ids, ``add_bos_token``) and ``tokenizer.chat_template``.
That conversion is the reference for how the file tokenizes, but it costs ~4 s, so its result is saved
with ``save_pretrained`` under the cache directory and every load, the first included, reads that saved
copy (~0.1 s): all starts tokenize through the same files.

The cache entry is keyed by the GGUF file's name, size and mtime (ns) and the transformers version, so an
edited or replaced file, or a transformers upgrade, gets a fresh entry. Entries are written to a temporary
directory and renamed into place, so a reader never sees a half-written one.

Cache directory: the ``cache_dir`` argument, else ``$KV8_CACHE_DIR``, else ``~/.cache/kv8``
(`default_cache_dir`, through :mod:`kv8.envs`).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kv8 import envs

TOKENIZER_KINDS: tuple[str, ...] = ("gguf", "hf")
# Files a Hugging Face model directory holds its tokenizer in (fast, SentencePiece, GPT-2 BPE, tiktoken).
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model",
                                    "tokenizer.tiktoken")
CACHE_DIR_ENV = envs.CACHE_DIR_ENV


def default_cache_dir() -> str:
    """``$KV8_CACHE_DIR`` when set and non-empty, else ``~/.cache/kv8`` (see :mod:`kv8.envs`)."""
    return envs.cache_dir()


def gguf_tokenizer_cache_path(path: str, cache_dir: str | None = None) -> str:
    """The directory that holds (or will hold) the converted tokenizer of the GGUF file ``path``."""
    stat = os.stat(path)
    key = f"{os.path.basename(path)}-{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    return os.path.join(cache_dir or default_cache_dir(), "tokenizers", key)


def _convert_gguf_tokenizer(path: str, target: str) -> None:
    """Build the tokenizer of ``path`` with transformers and save it at ``target`` (atomically)."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    try:
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not os.path.isdir(target):  # not a concurrent writer having won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_tokenizer(kind: str, path: str, cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a model resolved by `kv8.loader.sources.resolve_model_path`.

    ``kind`` is ``"hf"`` (``path`` a model directory: `AutoTokenizer.from_pretrained`) or ``"gguf"``
    (``path`` a .gguf file: converted once, then read from the cache; see the module docstring). The
    result carries the chat template, bos/eos tokens and ``add_bos_token`` of the source.
    """
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer kind must be one of {list(TOKENIZER_KINDS)}, got {kind!r}")
    if kind == "hf":
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer path for kind 'hf' must be a model directory, got {path!r}")
        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise ValueError(f"{path}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); copy the "
                             "model's tokenizer into this directory")
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}: cannot load the tokenizer: {e}") from None
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer path for kind 'gguf' must be a .gguf file, got {path!r}")
    cached = gguf_tokenizer_cache_path(os.path.abspath(path), cache_dir)
    if not os.path.isdir(cached):
        _convert_gguf_tokenizer(os.path.abspath(path), cached)
    return AutoTokenizer.from_pretrained(cached)
