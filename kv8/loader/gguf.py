"""Reading a GGUF checkpoint (llama.cpp's format) as a Hugging Face config and HF-named torch tensors.

`read_gguf` parses the metadata into a ``config.json``-style dict (`GGUFModel.hf_config`) and checks the
tensor table up front (every tensor maps to a known HF name, has a supported type and the shape the config
implies), so a bad file fails before any weight is dequantized. `iter_gguf_tensors` then yields
``(hf_name, tensor)`` pairs one at a time, dequantized with `gguf.quants.dequantize` (numpy, float32) and
cast to the compute dtype, so peak memory is one float32 tensor beyond the model itself.

Invariants of the yielded tensors:

* shapes are Hugging Face's (``[out_features, in_features]``); GGUF stores dimensions fastest-first, i.e.
  reversed, and the dequantized numpy array is already in HF order;
* for the ``llama`` architecture, llama.cpp's converter reorders the rows of every attention head of
  ``q_proj``/``k_proj`` (weights and biases) from HF's half-split rotary layout (``[x0..x(d/2-1),
  y0..y(d/2-1)]``) to an interleaved one (``[x0, y0, x1, y1, ...]``); the rows are put back here, so the
  tensors equal what transformers produces from the same file. ``qwen2`` and ``gemma3`` files are not permuted;
* for ``gemma3``, llama.cpp's converter stores every norm weight (``*norm.weight``: the four per-layer norms,
  QK-norm and the final norm) with Gemma's ``+1`` already added (its runtime multiplies by the weight); 1 is
  subtracted here, as transformers does, so the tensors are the checkpoint's ``w`` of ``(1 + w)``;
* with ``keep_blocks`` (``quantization="gguf"``: the decoder's linear weights, the embedding and the LM head), those
  tensors are yielded as the file's blocks (:class:`kv8.quant.gguf_blocks.GGUFWeight`), llama's q/k rows put back in
  the same way, each read from the file into its own array (``preadv``), not through the memory map, whose pages
  would otherwise stay resident beside the blocks (the parsed reader is kept for the process); those of a type no
  kernel reads (not in :data:`~kv8.quant.gguf_blocks.KEPT_TYPES`: Q5_K, Q3_K, F16, ...) dequantized alone to the
  compute dtype (:class:`~kv8.quant.gguf_blocks.ExpandedWeight`), with one warning naming the decoder's;
* ``lm_head.weight`` is yielded only when the file has ``output.weight``; otherwise
  ``hf_config["tie_word_embeddings"]`` is True and the embedding doubles as the output projection.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType

from kv8.quant.gguf_blocks import KEPT_TYPES, ExpandedWeight, GGUFWeight

logger = logging.getLogger("kv8")

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("gemma3", "llama", "qwen2")
# GGUF general.architecture -> (HF model_type, HF architecture); a gemma3 GGUF holds the text decoder only
_HF_NAMES = {
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}

SUPPORTED_TENSOR_TYPES: frozenset[QT] = frozenset({
    QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
})

_REQUIRED_CONFIG_KEYS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id",
)

# GGUF tensor name -> HF name; per-layer names are below and prefixed with blk.N. / model.layers.N.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Gemma 3 has four norms per layer (ffn_norm is the pre-feedforward one) and QK-norm
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_ARCH_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES, "llama": _LAYER_NAMES, "qwen2": _LAYER_NAMES}
# llama.cpp's default for gemma3 files that do not state it: every 6th layer global, local RoPE base 10k
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_ROPE_LOCAL_BASE = 10_000.0


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file's model description.

    ``hf_config`` is a Hugging Face ``config.json``-style dict (treat it as read-only) holding at least
    `_REQUIRED_CONFIG_KEYS`, plus the activation and, when the file states one, ``rope_scaling`` (gemma3:
    also ``sliding_window``, ``layer_types``, ``rope_local_base_freq`` and ``query_pre_attn_scalar``).
    ``model_type`` is the HF type of one of `SUPPORTED_ARCHITECTURES` (``gemma3`` -> ``gemma3_text``).
    """

    hf_config: dict[str, Any]
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"GGUFModel.path must be a non-empty string, got {self.path!r}")
        missing = [key for key in _REQUIRED_CONFIG_KEYS if key not in self.hf_config]
        if missing:
            raise ValueError(f"GGUFModel.hf_config is missing {missing}")
        model_types = [model_type for model_type, _ in _HF_NAMES.values()]
        if self.hf_config["model_type"] not in model_types:
            raise ValueError(f"GGUFModel.hf_config['model_type'] is {self.hf_config['model_type']!r}; "
                             f"supported: {model_types}")

    @property
    def architecture(self) -> str:
        """The GGUF architecture name (``general.architecture``)."""
        model_type = self.hf_config["model_type"]
        return next(arch for arch, (hf_type, _) in _HF_NAMES.items() if hf_type == model_type)


def _has_fast_get() -> bool:
    method = getattr(gguf.GGUFReader, "_get", None)
    if method is None:
        return False
    params = list(inspect.signature(method).parameters)
    return params[:5] == ["self", "offset", "dtype", "count", "override_order"]


class _FastGGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader` that slices its file through a plain ndarray view of the memory map.

    The stock reader parses ~100k tiny metadata parts (the vocabulary and merges) by slicing an
    ``np.memmap``, whose per-slice Python overhead is ~2/3 of its parse time (about 2 s for SmolLM2).
    The bytes and the values are the same; only the wrapper type differs (tensor ``data`` arrays become
    read-only ``np.ndarray`` views of the mapping instead of ``np.memmap``). This overrides the private
    ``GGUFReader._get``; `read_gguf` uses the stock reader when that method's signature is not the
    expected one, which costs time, never correctness.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_kv8_plain")
        if plain is None:
            plain = self.data.view(np.ndarray)
            self.__dict__["_kv8_plain"] = plain
        count = int(count)
        item_type = np.dtype(dtype)
        arr = plain[offset:offset + item_type.itemsize * count].view(item_type)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


_READER_CLASS: type[gguf.GGUFReader] = _FastGGUFReader if _has_fast_get() else gguf.GGUFReader


def _field_value(reader: gguf.GGUFReader, key: str) -> Any:
    """The scalar or string metadata value under ``key``, or None when the file lacks it."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value_type = field.types[0]
    if value_type == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata key {key!r} holds an array; a single value was expected")
    part = field.parts[field.data[0]]
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _require(reader: gguf.GGUFReader, key: str, path: str) -> Any:
    value = _field_value(reader, key)
    if value is None:
        raise ValueError(f"GGUF file {path!r} lacks the metadata key {key!r}")
    return value


def _rope_scaling(reader: gguf.GGUFReader, arch: str, path: str) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*``; None when absent or of type ``none``."""
    prefix = f"{arch}.rope.scaling."
    scaling_type = _field_value(reader, prefix + "type")
    factor = _field_value(reader, prefix + "factor")
    if scaling_type is None:
        if factor is not None and factor != 1.0:
            raise ValueError(f"GGUF file {path!r} has {prefix}factor={factor} but no {prefix}type")
        return None
    if scaling_type == "none":
        return None
    if scaling_type not in ("linear", "yarn"):
        raise ValueError(f"GGUF file {path!r} has {prefix}type={scaling_type!r}; supported: 'none', 'linear', 'yarn'")
    if factor is None:
        raise ValueError(f"GGUF file {path!r} has {prefix}type={scaling_type!r} but no {prefix}factor")
    scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": float(factor)}
    optional = {
        "original_context_length": "original_max_position_embeddings",
        "attn_factor": "attention_factor",
        "yarn_beta_fast": "beta_fast",
        "yarn_beta_slow": "beta_slow",
    }
    for gguf_key, hf_key in optional.items():
        value = _field_value(reader, prefix + gguf_key)
        if value is not None:
            scaling[hf_key] = value
    return scaling


def _hf_config(reader: gguf.GGUFReader, path: str) -> dict[str, Any]:
    arch = _require(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r} has architecture {arch!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"GGUF file {path!r} has a rope_freqs.weight tensor (Llama-3-style per-frequency rope "
                         f"factors), which kv8 does not support")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"GGUF file {path!r} lacks the metadata key 'tokenizer.ggml.tokens' (the vocabulary)")

    def key(name: str) -> Any:
        return _require(reader, f"{arch}.{name}", path)

    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    num_kv_heads = _field_value(reader, f"{arch}.attention.head_count_kv")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads  # llama.cpp's default: no GQA
    head_dim = _field_value(reader, f"{arch}.attention.key_length")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"GGUF file {path!r}: {arch}.embedding_length={hidden_size} is not divisible by "
                             f"{arch}.attention.head_count={num_heads} and there is no {arch}.attention.key_length")
        head_dim = hidden_size // num_heads
    for other in ("attention.value_length", "rope.dimension_count"):
        value = _field_value(reader, f"{arch}.{other}")
        if value is not None and value != head_dim:
            raise ValueError(f"GGUF file {path!r} has {arch}.{other}={value} but head_dim={head_dim}; kv8 supports "
                             f"only full-width rotary embeddings with equal key and value head sizes")
    if num_heads % num_kv_heads:
        raise ValueError(f"GGUF file {path!r}: head_count={num_heads} is not a multiple of "
                         f"head_count_kv={num_kv_heads}")
    rope_theta = _field_value(reader, f"{arch}.rope.freq_base")

    config: dict[str, Any] = {
        "model_type": _HF_NAMES[arch][0],
        "architectures": [_HF_NAMES[arch][1]],
        "vocab_size": len(tokens.data),
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        **({} if arch == "gemma3" else {"hidden_act": "silu"}),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": 10000.0 if rope_theta is None else float(rope_theta),  # llama.cpp's default
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field_value(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = _rope_scaling(reader, arch, path)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "gemma3":
        config |= _gemma3_config(reader, path, config)
    return config


def _array_value(reader: gguf.GGUFReader, key: str) -> list[Any] | None:
    """The array metadata value under ``key`` as a list, or None when the file lacks it."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return [field.parts[i][0].item() for i in field.data]


def _gemma3_config(reader: gguf.GGUFReader, path: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys, as llama.cpp runs the file (``src/llama-model.cpp``, LLM_ARCH_GEMMA3).

    * ``sliding_window`` from ``gemma3.attention.sliding_window`` (required);
    * ``layer_types`` from ``gemma3.attention.sliding_window_pattern`` when the file has it (an int period, or
      one bool per layer, true = sliding), else llama.cpp's fixed period 6 (layers 5, 11, ... global);
    * ``rope_local_base_freq`` from ``gemma3.rope.freq_base_swa``, else llama.cpp's 10000;
    * ``query_pre_attn_scalar``: llama.cpp scales queries by ``1/sqrt(key_length)``, except for the 62-layer
      (27B) model, ``1/sqrt(embedding_length / head_count)``; GGUF has no key for it;
    * ``hidden_activation``: gelu tanh; soft-capping keys (``gemma3.attn_logit_softcapping``,
      ``gemma3.final_logit_softcapping``) are passed on, so that the model names them when set.
    """
    layers = config["num_hidden_layers"]
    prefix = "gemma3.attention.sliding_window_pattern"
    field = reader.fields.get(prefix)
    if field is not None and field.types[0] == GGUFValueType.ARRAY:
        flags = _array_value(reader, prefix) or []
        if len(flags) != layers:
            raise ValueError(f"GGUF file {path!r} has {prefix} with {len(flags)} entries for {layers} layers")
        layer_types = ["sliding_attention" if flag else "full_attention" for flag in flags]
    else:
        period = _field_value(reader, prefix)
        period = _GEMMA3_SLIDING_WINDOW_PATTERN if period is None else int(period)
        if period < 1:
            raise ValueError(f"GGUF file {path!r} has {prefix}={period}; it must be >= 1")
        layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    local_base = _field_value(reader, "gemma3.rope.freq_base_swa")
    scalar = (config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"])
    extra: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _require(reader, "gemma3.attention.sliding_window", path),
        "layer_types": layer_types,
        "rope_local_base_freq": _GEMMA3_ROPE_LOCAL_BASE if local_base is None else float(local_base),
        "query_pre_attn_scalar": scalar,
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        extra[key] = _field_value(reader, f"gemma3.{key}")
    return extra


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of architecture ``arch`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``). Raises `ValueError` for a name with no mapping."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES[arch]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{int(parts[1])}.{names[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {_HF_NAMES[arch][1]} equivalent")


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its shape."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, hidden),
            p + "self_attn.k_proj.weight": (kv_rows, hidden),
            p + "self_attn.v_proj.weight": (kv_rows, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_rows),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if config["attention_bias"]:
            shapes |= {p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                       p + "self_attn.v_proj.bias": (kv_rows,)}
        if config["model_type"] == "gemma3_text":
            shapes |= {p + "pre_feedforward_layernorm.weight": (hidden,),
                       p + "post_feedforward_layernorm.weight": (hidden,),
                       p + "self_attn.q_norm.weight": (config["head_dim"],),
                       p + "self_attn.k_norm.weight": (config["head_dim"],)}
    return shapes


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(dim) for dim in reversed(tensor.shape.tolist()))  # GGUF lists dims fastest-first


def _check_tensors(reader: gguf.GGUFReader, model: GGUFModel) -> None:
    expected = _expected_shapes(model.hf_config)
    found: set[str] = set()
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, model.architecture)
        if name not in expected:
            raise ValueError(f"GGUF file {model.path!r} has tensor {tensor.name!r} ({name}), which its config "
                             f"does not imply (layers={model.hf_config['num_hidden_layers']}, "
                             f"attention_bias={model.hf_config['attention_bias']})")
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = sorted(t.name for t in SUPPORTED_TENSOR_TYPES)
            raise ValueError(f"GGUF tensor {tensor.name!r} in {model.path!r} has type {tensor.tensor_type.name}; "
                             f"supported: {supported}")
        if _hf_shape(tensor) != expected[name]:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {model.path!r} has shape {_hf_shape(tensor)} "
                             f"(HF order); the config implies {expected[name]}")
        found.add(name)
    missing = sorted(set(expected) - found)
    if missing:
        raise ValueError(f"GGUF file {model.path!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def read_gguf(path: str) -> tuple[GGUFModel, gguf.GGUFReader]:
    """Parse ``path`` (metadata and tensor table; the tensor data stays memory-mapped) and validate it.

    Raises `ValueError` for a missing or malformed file, an unsupported architecture (naming it and
    `SUPPORTED_ARCHITECTURES`), an unsupported tensor type, or tensors that do not match the config.
    """
    if not os.path.isfile(path):
        raise ValueError(f"GGUF path {path!r} is not a file")
    try:
        reader = _READER_CLASS(path)
    except (ValueError, KeyError, IndexError) as error:
        raise ValueError(f"GGUF file {path!r} could not be parsed: {error}") from error
    model = GGUFModel(hf_config=_hf_config(reader, path), path=path)
    _check_tensors(reader, model)
    return model, reader


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of rotary rows: within each head, GGUF row ``2*i + j`` is HF row
    ``j*d/2 + i`` (``j`` in {0, 1}, ``d`` the head size). Works on weights ``[rows, in]`` and biases ``[rows]``."""
    half = weight.shape[0] // num_heads // 2
    # (heads, d/2, 2, *rest) -> (heads, 2, d/2, *rest)
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dequantize(tensor: Any) -> torch.Tensor:
    """float32 torch tensor in HF shape; never a view of the (read-only) file mapping."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    array = array.reshape(_hf_shape(tensor))
    if not array.flags.writeable or array.dtype != np.float32:
        array = array.astype(np.float32, copy=True)
    return torch.from_numpy(array)


def _blocks(tensor: Any, fd: int) -> GGUFWeight:
    """The tensor's blocks as they are in the file, rows in HF shape order: read from the open file ``fd`` straight
    into a new array, not copied out of the reader's memory map, so the process does not keep the file's pages
    mapped beside the copy (an 8B Q4_K file: 4.3 GB more resident at load)."""
    rows, in_features = _hf_shape(tensor)
    array = np.empty(int(tensor.n_bytes), dtype=np.uint8)
    view, done = array.data, 0   # (a memoryview of the array)
    while done < len(array):
        count = os.preadv(fd, [view[done:]], int(tensor.data_offset) + done)
        if count <= 0:
            raise ValueError(f"GGUF tensor {tensor.name!r}: the file ends {len(array) - done} bytes before its data")
        done += count
    return GGUFWeight(tensor.tensor_type.name, torch.from_numpy(array.reshape(rows, -1)), in_features, tensor.name)


def _rotary_heads(model: GGUFModel, name: str) -> int:
    """The heads whose rows llama.cpp interleaved in tensor ``name`` (llama's q_proj / k_proj), else 0."""
    if model.architecture != "llama" or ".self_attn." not in name:
        return 0
    config = model.hf_config
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    return heads.get(name.split(".")[-2], 0)


def _hf_tensor(tensor: Any, name: str, model: GGUFModel, dtype: torch.dtype) -> torch.Tensor:
    """One tensor dequantized to ``dtype``, in HF row order and (gemma3) with HF's norm offsets."""
    weight = _dequantize(tensor)
    heads = _rotary_heads(model, name)
    if heads:
        weight = _unpermute_rotary_rows(weight, heads)
    elif model.architecture == "gemma3" and name.endswith("norm.weight"):
        weight = weight - 1.0   # llama.cpp stored 1 + w
    return weight.to(dtype).contiguous()


def _check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")


def iter_gguf_tensors(reader: gguf.GGUFReader, model: GGUFModel,
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the file, in file order, dequantized to ``dtype``.

    ``reader`` and ``model`` must come from the same `read_gguf` call. Tensors are contiguous, own their
    memory, and have HF shapes, (for llama) HF row order and (for gemma3) HF's norm offsets; see the module
    docstring.
    """
    _check_dtype(dtype)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, model.architecture)
        yield name, _hf_tensor(tensor, name, model, dtype)


def _type_counts(tensors: list[Any]) -> str:
    """``"Q4_K: 27, Q5_0: 81"``: the tensors' types with how many have each."""
    counts: dict[str, int] = {}
    for tensor in tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return ", ".join(f"{qtype}: {n}" for qtype, n in sorted(counts.items()))


_DECODER_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_decoder_linear(hf_name: str) -> bool:
    return hf_name.startswith("model.layers.") and hf_name.endswith(".weight") and \
        hf_name.split(".")[-2] in _DECODER_LINEAR


def _warn_expanded(reader: gguf.GGUFReader, model: GGUFModel, keep_blocks: Collection[str], dtype: torch.dtype) -> None:
    """One warning naming the decoder's tensors of ``keep_blocks`` whose type no kernel reads (dequantized alone to
    ``dtype``) and what stays as blocks; nothing when every one is kept. (An embedding or LM head of such a type is
    dequantized as without ``quantization="gguf"``, without a warning; ``kv8 info`` and the load line say so.)"""
    chosen = [t for t in reader.tensors if hf_tensor_name(t.name, model.architecture) in keep_blocks
              and _is_decoder_linear(hf_tensor_name(t.name, model.architecture))]
    expanded = [t for t in chosen if t.tensor_type.name not in KEPT_TYPES]
    if not expanded:
        return
    kept = [t for t in chosen if t.tensor_type.name in KEPT_TYPES]
    names = ", ".join(t.name for t in expanded[:3]) + (", ..." if len(expanded) > 3 else "")
    size = sum(int(t.n_elements) for t in expanded) * torch.empty(0, dtype=dtype).element_size()
    logger.warning("quantization='gguf': %d of the %d decoder weight tensors have a type without a kv8 kernel (%s; "
                   "%s); each is dequantized alone to %s (%.1f MiB); the other %d stay as the file's blocks (%s)",
                   len(expanded), len(chosen), _type_counts(expanded), names, str(dtype).removeprefix("torch."),
                   size / 2**20, len(kept), _type_counts(kept) or "none")


def iter_gguf_weights(reader: gguf.GGUFReader, model: GGUFModel, dtype: torch.dtype,
                      keep_blocks: Collection[str]) -> Iterator[tuple[str, torch.Tensor | GGUFWeight | ExpandedWeight]]:
    """`iter_gguf_tensors`, except that the tensors named (by HF name) in ``keep_blocks`` come as their blocks, a
    :class:`~kv8.quant.gguf_blocks.GGUFWeight` in HF row order (``quantization="gguf"``), or, for a type not in
    :data:`~kv8.quant.gguf_blocks.KEPT_TYPES`, dequantized to ``dtype`` alone as an
    :class:`~kv8.quant.gguf_blocks.ExpandedWeight` (one warning, before the first tensor, names those)."""
    _check_dtype(dtype)
    _warn_expanded(reader, model, keep_blocks, dtype)
    fd = os.open(model.path, os.O_RDONLY)
    try:
        for tensor in reader.tensors:
            name = hf_tensor_name(tensor.name, model.architecture)
            if name not in keep_blocks:
                yield name, _hf_tensor(tensor, name, model, dtype)
            elif tensor.tensor_type.name not in KEPT_TYPES:
                yield name, ExpandedWeight(tensor.tensor_type.name, _hf_tensor(tensor, name, model, dtype),
                                           tensor.name)
            else:
                kept = _blocks(tensor, fd)
                heads = _rotary_heads(model, name)
                if heads:   # whole rows of blocks move: a row permutation commutes with per-row quantization
                    kept = replace(kept, blocks=_unpermute_rotary_rows(kept.blocks, heads).contiguous())
                yield name, kept
    finally:
        os.close(fd)


def gguf_block_summary(reader: gguf.GGUFReader, model: GGUFModel) -> str:
    """``"Q4_1: 210 tensors, 63.3 MiB"``: the types and bytes of the decoder's linear weights that
    ``quantization="gguf"`` keeps as blocks, then (``"; dequantized at load: Q5_K: 9 tensors, 7.4 MiB in the
    file"``) those of the types it expands."""
    kept: dict[str, list[int]] = {}
    expanded: dict[str, list[int]] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, model.architecture)
        if not name.endswith(".weight") or name.split(".")[-2] not in _DECODER_LINEAR:
            continue
        qtype = tensor.tensor_type.name
        entry = (kept if qtype in KEPT_TYPES else expanded).setdefault(qtype, [0, 0])
        entry[0] += 1
        entry[1] += int(tensor.n_bytes)

    def listed(counts: dict[str, list[int]]) -> str:
        return "; ".join(f"{qtype}: {n} tensors, {size / 2**20:.1f} MiB" for qtype, (n, size) in sorted(counts.items()))

    text = listed(kept) or "none"
    return text + (f"; dequantized at load: {listed(expanded)} in the file" if expanded else "")


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _table_held(tensor: Any, dtype: torch.dtype) -> str:
    """How ``quantization="gguf"`` holds an embedding or LM head tensor: its blocks, or dequantized to ``dtype``."""
    qtype = tensor.tensor_type.name
    if qtype in KEPT_TYPES:
        return f"{qtype} blocks, {_mib(int(tensor.n_bytes))}"
    size = int(tensor.n_elements) * torch.empty(0, dtype=dtype).element_size()
    return f"{qtype} dequantized to {str(dtype).removeprefix('torch.')} at load, {_mib(size)}"


def gguf_table_summary(reader: gguf.GGUFReader, model: GGUFModel, dtype: torch.dtype, packed: bool) -> str:
    """``"embedding Q8_0 blocks, 28.7 MiB; LM head tied: the embedding's blocks"``: how ``quantization="gguf"`` holds
    the token embedding and the LM head (blocks where a kernel reads the type, else dequantized to ``dtype``); a tied
    head of a dequantized table gets its own copy packed for the bf16 kernel where ``packed``."""
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    text = f"embedding {_table_held(embd, dtype)}; LM head "
    if "output.weight" in tensors:
        return text + _table_held(tensors["output.weight"], dtype)
    if embd.tensor_type.name in KEPT_TYPES:
        return text + "tied: the embedding's blocks"
    return text + ("tied: a copy of the embedding's table packed for the bf16 kernel" if packed else
                   "tied: the embedding's table")


def gguf_resident_bytes(reader: gguf.GGUFReader, model: GGUFModel, dtype: torch.dtype, packed: bool) -> int:
    """The bytes of the weights a model loaded from the file with ``quantization="gguf"`` holds: the file's bytes of
    each decoder linear, embedding and LM head tensor of a kept type (a tied head shares the embedding's), every
    other tensor dequantized to ``dtype`` (biases in float32), and where ``packed``, a tied head's packed bf16 copy of
    a dequantized table. Packing may pad rows; the rotary embedding's small buffers are not counted."""
    item = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, model.architecture)
        kept = tensor.tensor_type.name in KEPT_TYPES
        if kept and (_is_decoder_linear(name) or tensor.name in ("token_embd.weight", "output.weight")):
            total += int(tensor.n_bytes)
        else:
            total += int(tensor.n_elements) * (4 if name.endswith(".bias") else item)
        if tensor.name == "token_embd.weight" and model.hf_config["tie_word_embeddings"] and not kept and packed:
            total += int(tensor.n_elements) * 2
    return total


def gguf_weight_types(reader: gguf.GGUFReader, model: GGUFModel) -> dict[str, str]:
    """The file's type of each weight ``dense_backend="auto"`` times ``quantization="gguf"``'s layers in
    (:func:`kv8.loader.model.linear_shapes`), by Hugging Face name: the decoder's linear weights, and the LM head's
    (``lm_head.weight``: ``output.weight``'s, or the tied embedding's)."""
    types = {name: tensor.tensor_type.name for tensor in reader.tensors
             if _is_decoder_linear(name := hf_tensor_name(tensor.name, model.architecture))}
    tensors = {t.name: t for t in reader.tensors}
    types["lm_head.weight"] = tensors.get("output.weight", tensors["token_embd.weight"]).tensor_type.name
    return types
