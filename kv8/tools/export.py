"""Write calibrated KV scales: vLLM JSON, kv8 JSON, or a model directory with scale tensors.

``save_model_with_scales`` writes a Hugging Face model directory that any kv8 engine loads with its scales
and no extra option:

* from a Hugging Face directory: a copy of every file, with the scale tensors added to the safetensors
  weights (a single weights file is rewritten with them; several files get one more,
  ``kv_cache_scales.safetensors``, listed in ``model.safetensors.index.json`` when there is one); scale
  tensors the source already had are dropped;
* from a GGUF file: ``config.json`` (the file's configuration), ``model.safetensors`` (the weights
  dequantized to float32, so loading it gives the same model as loading the GGUF in any compute dtype) and
  the tokenizer files.

Tensors per layer ``N`` (float32): ``model.layers.N.self_attn.k_scale`` and ``v_scale`` (scalars for tensor
granularity, ``[num_kv_heads]`` for head granularity) and TGI's ``kv_scale`` (one scalar, the largest of the
layer's K and V scales). ``config.json`` gets ``kv_cache_torch_dtype`` naming the fp8 format the scales were
made for. Channel granularity and E5M2 scales cannot be expressed this way and raise ValueError.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from kv8.cache.scale_sources import is_kv_scale_name
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling
from kv8.quant.scale_files import write_kv8_scales_json, write_vllm_scales_json
from kv8.quant.scales import KVScales, ModelScaleInfo, ScaleGranularity

__all__ = ["KEY_CENTERING_NEEDS_KV8", "OUTPUT_FORMATS", "RANKS_NEED_VLLM", "scale_tensors", "save_model_with_scales",
           "write_scales"]

OUTPUT_FORMATS = ("vllm", "kv8")
_CONFIG_DTYPE = {"fp8_e4m3": "float8_e4m3fn", "fp8_e4m3fnuz": "float8_e4m3fnuz"}
_INDEX = "model.safetensors.index.json"
_SCALES_SHARD = "kv_cache_scales.safetensors"
RANKS_NEED_VLLM = ("kv8's scales JSON holds no per-rank scales: with --tensor-parallel-size > 1 and tensor granularity "
                   "write --output-format vllm (scaling_factor[tp_rank]), or use --granularity head (an engine cuts "
                   "per-head scales to the heads of its rank)")


def vllm_view(scales: KVScales) -> KVScales:
    """Tensor-granularity scales with K == V == the larger of the two per layer (what vLLM files hold)."""
    if scales.granularity is not ScaleGranularity.TENSOR:
        raise ValueError(f"a vLLM scales file holds one scale per layer; got {scales.granularity.value} "
                         "granularity (use --output-format kv8, or --granularity tensor)")
    both = torch.maximum(scales.k, scales.v)
    return KVScales(k=both, v=both, granularity=scales.granularity, source=scales.source, made_for=scales.made_for,
                    rotation=scales.rotation)


KEY_CENTERING_NEEDS_KV8 = ("key offsets (--key-centering) are written only in kv8's scales JSON: a vLLM file or a "
                           "model's scale tensors cannot carry them")


def write_scales(path: str, scales: KVScales, info: ModelScaleInfo, output_format: str,
                 rank_scales: Sequence[KVScales] | None = None, key_offsets: KeyOffsets | None = None,
                 key_scaling: KeyScaling | None = None) -> None:
    """Write ``scales`` to ``path`` as ``output_format`` ("vllm" or "kv8"). ``rank_scales`` (one per
    tensor-parallel rank, tensor granularity) go into a vLLM file's ``scaling_factor[tp_rank]`` instead; kv8's
    schema has no ranks and refuses them. ``key_offsets`` (key centering) and ``key_scaling`` need the kv8
    schema."""
    if key_offsets is not None and output_format != "kv8":
        raise ValueError(f"{KEY_CENTERING_NEEDS_KV8}; use --output-format kv8")
    if output_format == "vllm":
        if scales.made_for not in _CONFIG_DTYPE:
            raise ValueError(f"a vLLM scales file is only defined for {sorted(_CONFIG_DTYPE)}; these scales are for "
                             f"{scales.made_for} (use --output-format kv8)")
        write_vllm_scales_json(path, [vllm_view(s) for s in rank_scales] if rank_scales else vllm_view(scales),
                               info.model_type)
    elif output_format == "kv8":
        if rank_scales:
            raise ValueError(RANKS_NEED_VLLM)
        write_kv8_scales_json(path, scales, info, key_offsets, key_scaling)
    else:
        raise ValueError(f"output format {output_format!r} is not known; choose one of: {', '.join(OUTPUT_FORMATS)}")


def scale_tensors(scales: KVScales) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (``k_scale``, ``v_scale``, ``kv_scale`` per layer) that carry ``scales``."""
    if scales.granularity is ScaleGranularity.CHANNEL:
        raise ValueError("checkpoint scale tensors are per layer or per KV head; channel-granularity scales "
                         "cannot be stored in a model (write a kv8 JSON file instead)")
    if scales.made_for not in _CONFIG_DTYPE:
        raise ValueError(f"config.json kv_cache_torch_dtype can only name {sorted(_CONFIG_DTYPE)}; these scales "
                         f"are for {scales.made_for}")
    out: dict[str, torch.Tensor] = {}
    for i in range(scales.num_layers):
        k, v = scales.k[i, :, 0], scales.v[i, :, 0]                       # [1] or [H]
        prefix = f"model.layers.{i}.self_attn."
        per_tensor = scales.granularity is ScaleGranularity.TENSOR
        out[prefix + "k_scale"] = (k[0] if per_tensor else k).clone().contiguous()
        out[prefix + "v_scale"] = (v[0] if per_tensor else v).clone().contiguous()
        out[prefix + "kv_scale"] = torch.maximum(k.max(), v.max()).clone()
    return out


def _prepare_dir(out_dir: str, source: str) -> None:
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"--save-model directory {out_dir!r} exists and is not empty; give a new directory")
    if os.path.abspath(out_dir) == os.path.abspath(source):
        raise ValueError("--save-model must not be the source model directory")
    os.makedirs(out_dir, exist_ok=True)


def _write_config(out_dir: str, hf_config: dict[str, Any], scales: KVScales) -> None:
    cfg = dict(hf_config)
    cfg["kv_cache_torch_dtype"] = _CONFIG_DTYPE[str(scales.made_for)]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def _save_from_hf(source: str, out_dir: str, new: dict[str, torch.Tensor]) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(n for n in os.listdir(source) if n.endswith(".safetensors"))
    sharded = os.path.isfile(os.path.join(source, _INDEX))
    target = shards[0] if len(shards) == 1 and not sharded else None     # else the scales get their own file
    for name in os.listdir(source):
        src = os.path.join(source, name)
        if name in shards or name in ("config.json", _INDEX) or not os.path.isfile(src):
            continue
        shutil.copy2(src, os.path.join(out_dir, name))
    for name in shards:
        with safe_open(os.path.join(source, name), framework="pt") as f:
            keys, metadata = list(f.keys()), f.metadata() or {"format": "pt"}
            if name == target or any(is_kv_scale_name(k) for k in keys):
                tensors = {k: f.get_tensor(k) for k in keys if not is_kv_scale_name(k)}
                if name == target:
                    tensors.update(new)
                save_file(tensors, os.path.join(out_dir, name), metadata=metadata)
                continue
        shutil.copy2(os.path.join(source, name), os.path.join(out_dir, name))
    if target is None:
        save_file(new, os.path.join(out_dir, _SCALES_SHARD), metadata={"format": "pt"})
    if sharded:
        with open(os.path.join(source, _INDEX), encoding="utf-8") as f:
            index = json.load(f)
        weight_map = {k: v for k, v in index.get("weight_map", {}).items() if not is_kv_scale_name(k)}
        weight_map.update({k: _SCALES_SHARD for k in new})
        index["weight_map"] = weight_map
        with open(os.path.join(out_dir, _INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")


def _save_from_gguf(path: str, out_dir: str, new: dict[str, torch.Tensor], hf_config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    from kv8.loader.gguf import iter_gguf_tensors, read_gguf
    from kv8.loader.tokenizer import load_tokenizer

    gguf_model, reader = read_gguf(path)
    tensors = dict(iter_gguf_tensors(reader, gguf_model, torch.float32))
    if hf_config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    tensors.update(new)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer("gguf", path).save_pretrained(out_dir)


def save_model_with_scales(model: str, out_dir: str, scales: KVScales) -> str:
    """Write a Hugging Face directory for ``model`` (alias, HF directory or GGUF file) carrying ``scales``;
    returns the directory. See the module docstring for what is written."""
    from kv8.loader.model import read_model_config
    from kv8.loader.sources import resolve_model_path

    if scales.rotation != "none":
        raise ValueError(f"--save-model writes checkpoint scales, which cannot say they were calibrated on "
                         f"{scales.rotation}-rotated K/V; write them with --output (kv8 JSON) instead")
    new = scale_tensors(scales)
    kind, path = resolve_model_path(model)
    hf_config = read_model_config(kind, path)
    _prepare_dir(out_dir, path)
    if kind == "hf":
        _save_from_hf(path, out_dir, new)
    else:
        hf_config.setdefault("torch_dtype", "float32")
        _save_from_gguf(path, out_dir, new, hf_config)
    _write_config(out_dir, hf_config, scales)
    return out_dir
