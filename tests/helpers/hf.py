"""Transformers as the oracle of kv8's models: its logits (optionally reading K/V rounded to FP8 by ml_dtypes), kv8's
paged model computing the same tokens in chunks, and checkpoints edited to test the loader."""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Callable

import torch

from kv8.attention.backend import ReferenceBackend
from kv8.attention.metadata import AttentionMetadata
from kv8.cache.codec import KVCodec
from kv8.cache.layout import KVCacheLayout
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.layers.attention import AttentionContext
from kv8.loader.model import load_model
from kv8.quant.formats import resolve_kv_cache_dtypes, split_kv_cache_dtype
from kv8.quant.rotation import hadamard
from kv8.quant.scales import KVScales

#: kv8's FP8 cache dtypes and the ml_dtypes type that rounds like each
FP8_NP = {"fp8_e4m3": "float8_e4m3fn", "fp8_e4m3fnuz": "float8_e4m3fnuz", "fp8_e5m2": "float8_e5m2"}
#: tokens per block of :func:`run_paged`'s cache
BLOCK = 8


def run_paged(path: str, kv_name: str, tokens: list[int], chunks: list[int], dynamic: bool = False,
              rotation: bool = False) -> torch.Tensor:
    """Logits [len(tokens), V] from kv8, computing the tokens in the given chunk sizes.

    The cache is laid out as the engine lays it out (:class:`KVCacheLayout`: one block table per group of
    layers, each group's metadata with its sliding window), so sliding-window layers attend to their window.
    """
    loaded = load_model("hf", path, torch.float32)
    arch = loaded.arch
    kv_dtype, v_dtype = resolve_kv_cache_dtypes(kv_name, torch.float32)   # a K/V pair: each side's
    scales = KVScales.default(arch.num_layers) if kv_dtype.is_fp8 and not dynamic and kv_dtype == v_dtype else None
    codec = KVCodec.build(kv_dtype, arch.head_dim, scale_mode="dynamic" if dynamic else "static",
                          rotation="hadamard" if rotation else "none", scales=scales, v_dtype=v_dtype)
    layout = KVCacheLayout.build(arch.layer_windows)
    nblocks = -(-len(tokens) // BLOCK)
    total = nblocks * len(layout.groups) + 2
    cache = PagedKVCache(CacheShape(arch.num_layers, total, arch.num_kv_heads, BLOCK, arch.head_dim), codec,
                         dict(enumerate(layout.layer_slot)))
    # out-of-order block ids, disjoint between groups; blocks 0 and 1 unused
    tables = [[total - 1 - g * nblocks - i for i in range(nblocks)] for g in range(len(layout.groups))]
    out, start = [], 0
    for n in chunks:
        end = start + n
        metas = [AttentionMetadata.build([n], [end], [tables[g.group_id]], BLOCK, sliding_window=g.sliding_window)
                 for g in layout.groups]
        per_layer = tuple((cache, metas[g]) for g in layout.layer_group)
        ctx = AttentionContext(cache, metas[0], ReferenceBackend(), per_layer=per_layer)
        hidden = loaded.model(torch.tensor(tokens[start:end]), torch.arange(start, end), ctx)
        out.append(loaded.model.compute_logits(hidden))
        start = end
    return torch.cat(out)


def register_fp8_attention(kv_name: str, dynamic: bool = False, rotation: bool = False) -> str:
    """Register with transformers an eager attention that reads K/V rounded to FP8 by ml_dtypes.

    Scale 1.0, or (``dynamic``) a scale per token and head of amax / format max. With ``rotation`` the values
    are rounded in the Hadamard basis and rotated back: ``fq(k R) R``, which is what scoring ``q R`` against
    stored ``fq(k R)`` computes. ``kv_name`` may be a K/V pair ``"K/V"`` of FP8, bfloat16 and float32 formats
    (each side rounded by its own; a pair's FP8 sides always with dynamic scales, as kv8 stores them).
    """
    k_name, v_name = split_kv_cache_dtype(kv_name) or (kv_name, kv_name)
    if (k_name, v_name) != (kv_name, kv_name):
        round_k, round_v = (_side_rounding(n, True, rotation) for n in (k_name, v_name))
        return _register(f"kv8_test_{k_name}_{v_name}_{rotation}", round_k, round_v)
    fake_quant = _side_rounding(kv_name, dynamic, rotation)
    return _register(f"kv8_test_{kv_name}_{dynamic}_{rotation}", fake_quant, fake_quant)


def _register(name: str, round_k: Callable[[torch.Tensor], torch.Tensor],
              round_v: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """An eager attention reading ``round_k(key)`` and ``round_v(value)``, registered with transformers as ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        return eager_attention_forward(module, query, round_k(key), round_v(value), attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # the same causal mask as eager
    return name


def _side_rounding(kv_name: str, dynamic: bool, rotation: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a cache of ``kv_name`` (an FP8 format by ml_dtypes, or bfloat16 / float32) does to K or V ``[B, H, S,
    D]`` (see :func:`register_fp8_attention`)."""
    import ml_dtypes
    import numpy as np

    rot = hadamard(16).double() if rotation else None   # the tiny models' head_dim
    if kv_name not in FP8_NP:
        cast = {"bfloat16": torch.bfloat16, "float32": torch.float32}[kv_name]
        if rot is None:
            return lambda x: x.to(cast).float()
        return lambda x: (((x.double() @ rot).float().to(cast).double()) @ rot).float()
    np_dtype = getattr(ml_dtypes, FP8_NP[kv_name])
    fmax = float(ml_dtypes.finfo(np_dtype).max)

    def round_fp8(x: torch.Tensor) -> torch.Tensor:
        a = x.detach().float().numpy().clip(-fmax, fmax)
        return torch.from_numpy(a.astype(np_dtype).astype(np.float32))

    def fake_quant(x: torch.Tensor) -> torch.Tensor:   # x [B, H, S, D]
        if rot is not None:
            x = (x.double() @ rot).float()
        if dynamic:
            s = x.abs().amax(-1, keepdim=True) / fmax
            s = torch.where(s > 0, s, torch.ones_like(s))
            y = round_fp8(x / s) * s
        else:
            y = round_fp8(x)
        return (y.double() @ rot).float() if rot is not None else y

    return fake_quant


def hf_logits(path: str, tokens: list[int], kv_name: str = "float32", dynamic: bool = False,
              rotation: bool = False) -> torch.Tensor:
    """Logits [len(tokens), V] of transformers' float32 forward of ``tokens``, its attention reading K/V rounded to
    ``kv_name`` when that is an FP8 format (:func:`register_fp8_attention`)."""
    from transformers import AutoModelForCausalLM

    attn = register_fp8_attention(kv_name, dynamic, rotation) if kv_name in FP8_NP or "/" in kv_name else "eager"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def edited_checkpoint(src: str, dst: str, edit: Callable[[dict[str, torch.Tensor]], object]) -> str:
    """A copy of the checkpoint directory ``src`` at ``dst`` whose one safetensors file ``edit`` changed in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (file,) = glob.glob(os.path.join(dst, "*.safetensors"))
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return dst
