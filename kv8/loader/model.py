"""Load a model from a Hugging Face directory or a GGUF file, without a second copy of the weights.

Steps: pick the model class from the config (:func:`kv8.models.registry.model_class`) and the dense backend
(:func:`kv8.layers.dense_backend.select_dense_backend`, once); build the model on the meta device; load each
checkpoint tensor by its Hugging Face name -- a tensor of a merged layer (``packed_modules_mapping``, e.g.
``q_proj`` -> shard ``"q"`` of ``qkv_proj``) is copied into its rows by ``param.weight_loader(param, tensor,
shard_id)``, any other tensor -- a merged layer's whole matrix too, when the checkpoint stores it merged (Phi-3's
``qkv_proj``, ``gate_up_proj``; no ``packed_modules_mapping`` entry) -- is checked against the parameter's
shape, converted to the compute dtype and assigned as the parameter; tie weights
(``tied_weights``); then let every layer convert its loaded weights (``process_weights_after_loading``: the
packed_bf16 linear method packs them and drops the originals; on the CPU the free heap pages the conversion left are
handed back after each layer, :func:`kv8.host_memory.release_free_heap`). Missing and unknown tensors are errors that
name them. KV-scale tensors are collected for :mod:`kv8.cache.scale_sources` rather than loaded into the model.

Tensor parallelism: given a group (``tp``), the model is built for that rank (:func:`kv8.distributed.shard.
building_shard`), and every tensor of a sharded layer -- a whole one too -- goes through its
``weight_loader``, which keeps the rank's rows or columns. Replicated tensors (embedding, norms, lm_head) load
as above on every rank.
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kv8 import envs
from kv8.cache.scale_sources import is_kv_scale_name
from kv8.distributed.group import SINGLE_RANK, TPGroup
from kv8.distributed.shard import building_shard
from kv8.host_memory import place_on_huge_pages, release_free_heap
from kv8.layers.dense_backend import TORCH_BACKEND, DenseBackend, select_dense_backend
from kv8.layers.linear import GGUFSegment, LinearBase
from kv8.layers.tuning import LinearShape, tuned_dense_backend, tuned_gguf_paths
from kv8.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from kv8.models.config import ModelArchConfig
from kv8.models.registry import CausalLM, arch_config, model_class
from kv8.platform import CPU, Platform
from kv8.quant.gguf_blocks import KEPT_TYPES, ExpandedWeight, GGUFWeight

logger = logging.getLogger("kv8")

# Checkpoint entries that carry no weights kv8 needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    arch: ModelArchConfig
    hf_config: dict[str, Any]
    scale_tensors: dict[str, torch.Tensor]   # checkpoint KV-scale tensors by name (possibly empty)
    load_seconds: float
    dense_backend: str                       # the resolved dense backend: "torch", "torch_fp32" or "packed_bf16"


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
    from kv8.loader.gguf import read_gguf

    return read_gguf(path)


def keeps_gguf_blocks(kind: str, path: str) -> bool:
    """Whether model ``path`` is a GGUF file with decoder linear weights that ``quantization="gguf"`` keeps as blocks
    (of a type in :data:`~kv8.quant.gguf_blocks.KEPT_TYPES`; False for a file of F16 / F32 / other types only)."""
    if kind != "gguf":
        return False
    from kv8.loader.gguf import gguf_weight_types

    gguf_model, reader = _read_gguf(path, os.path.getmtime(path))
    types = gguf_weight_types(reader, gguf_model)   # the decoder's linear weights, and the LM head's
    return any(qtype in KEPT_TYPES for name, qtype in types.items() if name != "lm_head.weight")


def read_model_config(kind: str, path: str) -> dict[str, Any]:
    """The Hugging Face config dict of a model, without loading weights."""
    if kind == "gguf":
        return dict(_read_gguf(path, os.path.getmtime(path))[0].hf_config)
    if kind == "hf":
        return read_hf_config(path)
    raise ValueError(f"model kind {kind!r} is not one of: hf, gguf")


def _safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (kv8 never unpickles .bin/.pt files; convert them to safetensors)" if bins else ""
        raise ValueError(f"no *.safetensors weights in {path}{hint}")
    return files


def _bad_safetensors(file: str, e: Exception) -> ValueError:
    return ValueError(f"{file}: not a valid safetensors file ({e}); the file is truncated or corrupt: download or "
                      "convert it again")


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise _bad_safetensors(file, e) from None


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def _check_layer_count(files: list[str], arch: ModelArchConfig, path: str) -> None:
    """Compare the config's layer count with the layers the checkpoint holds (read from the file headers
    only), before a model of that many layers is built."""
    from safetensors import SafetensorError, safe_open

    found: set[int] = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                found.update(int(m.group(1)) for name in f.keys() if (m := _LAYER_NAME.match(name)))
        except (SafetensorError, OSError) as e:
            raise _bad_safetensors(file, e) from None
    count = max(found) + 1 if found else 0
    if count != arch.num_layers:
        held = f"layers model.layers.0 .. model.layers.{count - 1}" if count else "no model.layers.N tensors"
        raise ValueError(f"{os.path.join(path, 'config.json')} says num_hidden_layers={arch.num_layers}, but the "
                         f"checkpoint holds {held}")


def check_checkpoint_layers(kind: str, path: str, arch: ModelArchConfig) -> None:
    """The config's layer count against the checkpoint's (file headers only; a GGUF's config comes from the
    file itself). The engine calls it before anything is sized by the layer count."""
    if kind == "hf":
        _check_layer_count(_safetensors_files(path), arch, path)


ShardId = int | str | None


def _checkpoint_names(model: nn.Module, tied: dict[str, str]) -> dict[str, tuple[str, ShardId]]:
    """checkpoint tensor name -> (parameter name, shard id) for every tensor the model needs."""
    shards: dict[str, list[tuple[str, ShardId]]] = {}   # merged module -> [(checkpoint module, shard id)]
    for ckpt_module, (merged, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        shards.setdefault(merged, []).append((ckpt_module, shard_id))
    names: dict[str, tuple[str, ShardId]] = {}
    for pname, _ in model.named_parameters():
        if pname in tied:
            continue
        module_path, _, leaf = pname.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        for ckpt_module, shard_id in shards.get(module, [(module, None)]):
            names[f"{parent}.{ckpt_module}.{leaf}" if parent else f"{ckpt_module}.{leaf}"] = (pname, shard_id)
    return names


def _load(model: nn.Module, pname: str, tensor: torch.Tensor | GGUFWeight | ExpandedWeight, shard_id: ShardId,
          dtype: torch.dtype) -> None:
    module_path, _, leaf = pname.rpartition(".")
    module = model.get_submodule(module_path)
    if isinstance(tensor, (GGUFWeight, ExpandedWeight)):   # quantization="gguf": the layer keeps the blocks
        if isinstance(module, VocabParallelEmbedding) and leaf == "weight":
            module.load_gguf(tensor, dtype)
            return
        if not isinstance(module, LinearBase) or leaf != "weight":
            raise ValueError(f"is GGUF blocks, but {pname} is not a linear layer's or an embedding's weight")
        module.load_gguf(tensor, shard_id)
        return
    param = getattr(module, leaf)
    if shard_id is None and not getattr(module, "is_sharded", False):
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
        setattr(module, leaf, nn.Parameter(tensor.to(dtype), requires_grad=False))
        return
    if param.is_meta:   # the first shard allocates the merged parameter
        real = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="cpu"), requires_grad=False)
        real.weight_loader = param.weight_loader  # type: ignore[attr-defined]
        setattr(module, leaf, real)
        param = real
    param.weight_loader(param, tensor, shard_id)


def _init_dummy(model: nn.Module, dtype: torch.dtype, device: torch.device, seed: int) -> None:
    """Every parameter still on the meta device (none was loaded) -> random values on ``device``: 2-D normal with
    std 0.02, 1-D ones (norm weights) or zeros (biases)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if value.ndim >= 2:
                value.normal_(0.0, 0.02, generator=generator)
            else:
                value.fill_(0.0 if leaf == "bias" else 1.0)
            setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def _block_names(model: nn.Module, names: dict[str, tuple[str, ShardId]]) -> set[str]:
    """The checkpoint names of the weights that ``quantization="gguf"`` keeps as blocks: those of the linear layers
    that follow the quantization (under it, the LM head too) and of the embedding."""
    keep = set()
    for name, (pname, _) in names.items():
        module_path, _, leaf = pname.rpartition(".")
        module = model.get_submodule(module_path)
        if leaf == "weight" and (isinstance(module, LinearBase) and module.quantize
                                 or isinstance(module, VocabParallelEmbedding) and module.gguf):
            keep.add(name)
    return keep


def _tie(model: nn.Module, target: str, source: str) -> None:
    """Make parameter ``target`` (the LM head's weight) the parameter ``source`` (the embedding's); under
    ``quantization="gguf"``, hand the head the embedding's blocks (one copy) or its dequantized table."""
    module_path, _, leaf = target.rpartition(".")
    source_module = model.get_submodule(source.rpartition(".")[0])
    shared = source_module.tied_gguf_part() if isinstance(source_module, VocabParallelEmbedding) else None
    if shared is None:
        setattr(model.get_submodule(module_path), leaf, model.get_parameter(source))
        return
    head = model.get_submodule(module_path)
    if not isinstance(head, LinearBase):
        raise ValueError(f"{target} is tied to GGUF blocks, but {module_path} is not a linear layer")
    head.load_gguf(shared)


def resident_weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters and buffers (weights, blocks, packed layouts, biases; each storage once,
    so a tied pair counts once): what its weights keep resident."""
    storages: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if not t.is_meta:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def describe_gguf_blocks(model: nn.Module) -> str:
    """``"Q4_K: 27 tensors, Q5_0: 81 tensors as blocks, 72.1 MiB; dequantized at load: Q5_K: 9 tensors, 22.5 MiB;
    embedding Q8_0 blocks, 170.0 MiB; LM head tied: the embedding's blocks; resident weights 248.2 MiB"``: how the
    model's decoder linear layers hold their GGUF tensors (``quantization="gguf"``: the types kept as blocks with their
    tensor counts and resident bytes, then those expanded to the compute dtype), how the embedding and the LM head
    hold theirs, and the bytes of all its weights (:func:`resident_weight_bytes`)."""
    counts: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}
    total = {False: 0, True: 0}
    embedding = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)][0]
    head = [m for m in model.modules() if isinstance(m, ParallelLMHead)][0]
    tables = {id(s) for s in head.modules() if isinstance(s, GGUFSegment)} | {id(embedding.gguf_rows)}
    for module in model.modules():
        if isinstance(module, GGUFSegment) and id(module) not in tables:
            counts[module.expanded][module.qtype] += module.tensors
            total[module.expanded] += module.nbytes()

    def listed(expanded: bool) -> str:
        return ", ".join(f"{qtype}: {n} tensors" for qtype, n in sorted(counts[expanded].items()))

    text = f"{listed(False) or 'no tensors'} as blocks, {total[False] / 2**20:.1f} MiB"
    if counts[True]:
        text += f"; dequantized at load: {listed(True)}, {total[True] / 2**20:.1f} MiB"
    rows = embedding.gguf_rows
    if rows is not None:
        text += f"; embedding {rows.qtype} blocks, {rows.nbytes() / 2**20:.1f} MiB"
    else:
        table = embedding.weight
        text += (f"; embedding {embedding.gguf_qtype} dequantized at load, "
                 f"{table.numel() * table.element_size() / 2**20:.1f} MiB")
    (segment,) = head.gguf_segments
    assert isinstance(segment, GGUFSegment)
    if segment is rows:
        text += "; LM head tied: the embedding's blocks"
    else:
        how = "dequantized at load" if segment.expanded else "blocks"
        text += f"; LM head {segment.qtype} {how}, {segment.nbytes() / 2**20:.1f} MiB"
    return text + f"; resident weights {resident_weight_bytes(model) / 2**20:.1f} MiB"


def describe_weights(kind: str, path: str, quantization: str | None, dtype: torch.dtype = torch.bfloat16) -> str:
    """How the weights of model ``path`` are held with ``quantization`` (``kv8 info``): as loaded, FP8 codes, or
    (``"gguf"``) the file's blocks with their types, tensor counts and bytes, the types dequantized at load instead,
    how the embedding and the LM head are held, and the bytes resident in ``dtype`` against the file's size.
    ``ValueError`` when the model is not a GGUF file."""
    if quantization is None:
        return "as loaded, in the compute dtype (GGUF: dequantized at load)" if kind == "gguf" else "as loaded"
    if quantization == "fp8":
        return ("fp8: E4M3 codes with a float32 scale per output row, quantized at load; LM head and embedding as "
                "loaded")
    if kind != "gguf":
        raise ValueError(f"quantization={quantization!r} keeps the blocks of a GGUF file; {path} is a {kind} "
                         "checkpoint")
    from kv8.loader.gguf import gguf_block_summary, gguf_resident_bytes, gguf_table_summary

    gguf_model, reader = _read_gguf(path, os.path.getmtime(path))
    packed = select_dense_backend("auto", dtype, quantization).kernels is not None
    resident = gguf_resident_bytes(reader, gguf_model, dtype, packed)
    return (f"gguf: the file's blocks, not expanded ({gguf_block_summary(reader, gguf_model)}); "
            f"{gguf_table_summary(reader, gguf_model, dtype, packed)}; resident weights {resident / 2**20:.1f} MiB "
            f"(the file: {os.path.getsize(path) / 2**20:.1f} MiB)")


def linear_shapes(hf_config: dict[str, Any], tp: TPGroup = SINGLE_RANK,
                  gguf_types: Mapping[str, str] | None = None) -> list[LinearShape]:
    """The distinct shapes of the model's linear layers on rank ``tp.rank``, with how many layers have each (the
    model built on the meta device: no memory, no weights). ``gguf_types`` (``quantization="gguf"``, by Hugging Face
    name: :func:`kv8.loader.gguf.gguf_weight_types`): each decoder layer is a shape per run of its projections of one
    type (as :class:`~kv8.layers.linear.GGUFLinearMethod` holds them), with that ``qtype``; the LM head has its type
    (and follows the quantization) where it is kept as blocks."""
    with torch.device("meta"), building_shard(tp):
        model = model_class(hf_config)(arch_config(hf_config), TORCH_BACKEND)
    projection_types: dict[str, dict[int, str]] = {}   # module -> projection -> the file's type
    for name, (pname, shard_id) in _checkpoint_names(model, {}).items():
        path, _, leaf = pname.rpartition(".")
        layer = model.get_submodule(path)
        if gguf_types is not None and name in gguf_types and leaf == "weight" and isinstance(layer, LinearBase):
            for i in range(len(layer.output_sizes)) if shard_id is None else [layer.shard_index(shard_id)]:
                projection_types.setdefault(path, {})[i] = gguf_types[name]
    counts: Counter[tuple[int, int, bool, str | None, bool]] = Counter()
    for path, m in model.named_modules():
        if not isinstance(m, LinearBase):
            continue
        head, types = isinstance(m, ParallelLMHead), projection_types.get(path, {})
        if gguf_types is not None and m.quantize and not head:
            for qtype, run in itertools.groupby(range(len(m.output_sizes)), key=types.get):
                counts[(sum(m.output_sizes[i] for i in run), m.in_features, True, qtype, False)] += 1
            continue
        qtype = types.get(0) if head and types.get(0) in KEPT_TYPES else None
        counts[(m.out_features, m.in_features, m.quantize or qtype is not None, qtype, head)] += 1
    order = sorted(counts, key=lambda key: (key[:3], key[3] or "", key[4]))
    return [LinearShape(n, k, counts[(n, k, q, t, h)], q, t, h) for n, k, q, t, h in order]


def tuning_shapes(kind: str, path: str, hf_config: dict[str, Any], quantization: str | None,
                  tp: TPGroup = SINGLE_RANK) -> list[LinearShape]:
    """:func:`linear_shapes` as ``dense_backend="auto"`` times them: with ``quantization="gguf"`` on a GGUF file,
    in the file's block types."""
    if quantization != "gguf" or kind != "gguf":
        return linear_shapes(hf_config, tp)
    from kv8.loader.gguf import gguf_weight_types

    gguf_model, reader = _read_gguf(path, os.path.getmtime(path))
    return linear_shapes(hf_config, tp, gguf_weight_types(reader, gguf_model))


def resolve_dense_backend(name: str, hf_config: dict[str, Any], dtype: torch.dtype, quantization: str | None,
                          platform: Platform = CPU, tp: TPGroup = SINGLE_RANK,
                          shapes: Callable[[], list[LinearShape]] | None = None) -> DenseBackend:
    """The dense backend of option ``name``: ``auto`` on the CPU with one rank is this machine's measured choice
    for the model (:func:`kv8.layers.tuning.tuned_dense_backend` and, with GGUF blocks, the int8 kernel's path per type:
    :func:`~kv8.layers.tuning.tuned_gguf_paths`; unless ``KV8_TUNING=off``); everything else
    :func:`kv8.layers.dense_backend.select_dense_backend`'s fixed rule (tensor-parallel ranks too: each rank would
    time beside the others). ``shapes``: the shapes to time (default :func:`linear_shapes`; the loader passes
    :func:`tuning_shapes`')."""
    if name == "auto" and platform.kind == "cpu" and tp.size == 1 and envs.tuning():
        timed = shapes() if shapes is not None else linear_shapes(hf_config)
        backend = tuned_dense_backend(timed, dtype, quantization)[0]
        return tuned_gguf_paths(backend, timed, dtype)[0]   # (GGUF blocks: the int8 kernel's path per type)
    return select_dense_backend(name, dtype, quantization, platform)


def load_model(kind: str, path: str, dtype: torch.dtype, dense_backend: str = "torch",
               tp: TPGroup = SINGLE_RANK, quantization: str | None = None, platform: Platform = CPU,
               device: torch.device | None = None, load_format: str = "auto", seed: int = 0) -> LoadedModel:
    """Build the model for ``path`` (kind ``"hf"`` or ``"gguf"``) with weights in ``dtype`` and dense layers on
    ``dense_backend`` (a validated ``kv8.engine.config.DENSE_BACKENDS`` name; ``LoadedModel.dense_backend`` says which
    one ``auto`` resolved to); with a group ``tp``, the shard of its rank. ``quantization`` (None or a
    ``kv8.engine.config.QUANTIZATION_METHODS`` name): how the decoder's linear layers store their weights. The
    model ends on ``device``, one of ``platform``'s (default :attr:`kv8.platform.Platform.device`; the checkpoint
    is read and processed on the host, then moved). ``load_format="dummy"`` reads no tensor of the checkpoint:
    every parameter gets random values of its shape (normal, std 0.02, from ``seed``; 1-D ones, biases zeros),
    made on ``device`` directly -- the model's speed without its weights (vLLM's ``--load-format dummy``)."""
    start = time.perf_counter()
    device = platform.device if device is None else device
    if kind == "gguf":
        from kv8.loader.gguf import iter_gguf_weights

        gguf_model, reader = _read_gguf(path, os.path.getmtime(path))
        hf_config = dict(gguf_model.hf_config)
    elif kind == "hf":
        hf_config = read_hf_config(path)
        files = [] if load_format == "dummy" else _safetensors_files(path)
        tensors: Iterator[tuple[str, torch.Tensor | GGUFWeight | ExpandedWeight]] = _iter_safetensors(files)
    else:
        raise ValueError(f"model kind {kind!r} is not one of: hf, gguf")
    cls = model_class(hf_config)
    arch = arch_config(hf_config)
    if kind == "hf" and files:
        _check_layer_count(files, arch, path)
    backend = resolve_dense_backend(dense_backend, hf_config, dtype, quantization, platform, tp,
                                    lambda: tuning_shapes(kind, path, hf_config, quantization, tp))
    with torch.device("meta"), building_shard(tp):
        model = cls(arch, backend)
    tied = dict(getattr(model, "tied_weights", {})) if arch.tie_word_embeddings else {}
    names = _checkpoint_names(model, tied)
    if kind == "gguf":
        keep = _block_names(model, names) if backend.quantization == "gguf" else set()
        tensors = iter(()) if load_format == "dummy" else iter_gguf_weights(reader, gguf_model, dtype, keep)
    scale_tensors: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if is_kv_scale_name(name) and isinstance(tensor, torch.Tensor):
            scale_tensors[name] = tensor.float()
        elif name in names:
            pname, shard_id = names[name]
            try:
                _load(model, pname, tensor, shard_id, dtype)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name} {exc}") from None
            loaded.add(name)
        elif name in tied:
            continue  # some tied checkpoints store the copy; the shared parameter is used
        elif not name.endswith(_IGNORED_SUFFIXES):
            unexpected.append(name)
    if unexpected:
        raise ValueError(f"checkpoint {path} has tensors kv8 does not know ({len(unexpected)}, e.g. "
                         f"{', '.join(unexpected[:4])}); quantized weights other than GGUF are not supported")
    if load_format == "dummy":
        _init_dummy(model, dtype, device, seed)
        loaded = set(names)
    missing = sorted(set(names) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {', '.join(missing[:4])}")
    for target, source in tied.items():
        _tie(model, target, source)
    for module in model.modules():
        process = getattr(module, "process_weights_after_loading", None)
        if process is not None:
            process()
            if platform.kind == "cpu":   # the holes of the loaded form and the conversion's copies, layer by layer
                release_free_heap()
    model.eval()
    if platform.kind != "cpu":
        model.to(device)
    weights = f", {backend.quantization} weights" if backend.quantization else ""
    if backend.quantization == "gguf":
        weights = f", gguf weights ({describe_gguf_blocks(model)})"
    # a decode step streams every weight: 2 MiB pages on the host (kv8.host_memory)
    huge = place_on_huge_pages(model) if platform.kind == "cpu" else 0
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s, %d layers, %s, dense backend %s%s%s%s) in %.1f s", path, arch.model_type,
                arch.num_layers, f"random weights (load_format=dummy) on {device}" if load_format == "dummy"
                else f"on {device}", backend.label, weights,
                f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "",
                f", {huge / 2**20:.0f} MiB of weights in memory advised for 2 MiB pages" if huge else "", seconds)
    return LoadedModel(model, arch, hf_config, scale_tensors, seconds, backend.label)
