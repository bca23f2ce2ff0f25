"""Load a model from a Hugging Face directory or a GGUF file, without a second copy of the weights.

The model is built on the meta device; each checkpoint tensor is converted to the compute dtype and assigned
as the parameter directly. KV-scale tensors found in the checkpoint are collected for
:mod:`kv8.quant.scales` rather than loaded into the model.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from kv8.config import ModelArchConfig
from kv8.model.llama import LlamaForCausalLM
from kv8.quant.scales import is_kv_scale_name

logger = logging.getLogger("kv8")

# Checkpoint entries that carry no weights kv8 needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    hf_config: dict[str, Any]
    scale_tensors: dict[str, torch.Tensor]   # checkpoint KV-scale tensors by name (possibly empty)
    load_seconds: float


def read_hf_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the model config {cfg_path}: {e}") from None


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, mtime: float) -> tuple[Any, Any]:
    """Parse a GGUF file once per (path, mtime): the config read and the weight load share the parse."""
    from kv8.model.gguf_loader import read_gguf

    return read_gguf(path)


def read_model_config(kind: str, path: str) -> dict[str, Any]:
    """The Hugging Face config dict of a model, without loading weights."""
    if kind == "gguf":
        return dict(_read_gguf(path, os.path.getmtime(path))[0].hf_config)
    if kind == "hf":
        return read_hf_config(path)
    raise ValueError(f"model kind {kind!r} is not one of: hf, gguf")


def _iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (kv8 never unpickles .bin/.pt files; convert them to safetensors)" if bins else ""
        raise ValueError(f"no *.safetensors weights in {path}{hint}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_path, _, pname = name.rpartition(".")
    module = model.get_submodule(module_path)
    old = getattr(module, pname)
    if tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                         f"{tuple(old.shape)}")
    setattr(module, pname, nn.Parameter(tensor, requires_grad=False))


def load_model(kind: str, path: str, dtype: torch.dtype) -> LoadedModel:
    """Build the model for ``path`` (kind ``"hf"`` or ``"gguf"``) with weights in ``dtype``."""
    start = time.perf_counter()
    if kind == "gguf":
        from kv8.model.gguf_loader import iter_gguf_tensors

        gguf_model, reader = _read_gguf(path, os.path.getmtime(path))
        hf_config = dict(gguf_model.hf_config)
        tensors: Iterator[tuple[str, torch.Tensor]] = iter_gguf_tensors(reader, gguf_model, dtype)
    elif kind == "hf":
        hf_config = read_hf_config(path)
        tensors = _iter_safetensors(path)
    else:
        raise ValueError(f"model kind {kind!r} is not one of: hf, gguf")
    arch = ModelArchConfig.from_hf_config(hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    expected = {n for n, _ in model.named_parameters()}
    if arch.tie_word_embeddings:
        expected.discard("lm_head.weight")
    scale_tensors: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if is_kv_scale_name(name):
            scale_tensors[name] = tensor.float()
        elif name in expected:
            _assign(model, name, tensor.to(dtype))
            loaded.add(name)
        elif name == "lm_head.weight" and arch.tie_word_embeddings:
            continue  # some tied checkpoints store the copy; the embedding is used
        elif not name.endswith(_IGNORED_SUFFIXES):
            unexpected.append(name)
    if unexpected:
        raise ValueError(f"checkpoint {path} has tensors kv8 does not know ({len(unexpected)}, e.g. "
                         f"{', '.join(unexpected[:4])}); quantized weights other than GGUF are not supported")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {', '.join(missing[:4])}")
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s, %d layers) in %.1f s", path, arch.model_type, arch.num_layers, seconds)
    return LoadedModel(model, arch, hf_config, scale_tensors, seconds)
