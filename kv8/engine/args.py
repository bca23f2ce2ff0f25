"""The engine's options with vLLM's names, each declared once, and their conversion into a validated
:class:`kv8.engine.config.EngineConfig`.

:class:`EngineArgs` is the argument group of an engine: ``LLM(**kwargs)`` takes its fields, every ``kv8``
subcommand gets one flag per field (:class:`kv8.options.OptionGroup`), and ``kv8 generate --help`` / :meth:`describe`
list them. A field that is a config field as given (``block_size``, ``kv_cache_scale_mode``, ``max_num_seqs``,
``tensor_parallel_size`` ...) is declared in that config and taken from it (:func:`kv8.options.from_config`), so
its default, help and allowed values live in one place; the fields declared here are the ones the engine converts
(``dtype`` and ``kv_cache_dtype`` names, ``max_model_len`` None = the model's) or that no config holds (the model).

Values are checked once, by the configs :meth:`EngineArgs.create_engine_config` builds: a bad value raises
``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kv8.cache.budget import DEFAULT_MAX_MODEL_LEN, default_max_model_len
from kv8.cache.config import CacheConfig
from kv8.distributed.config import ParallelConfig
from kv8.engine.config import (
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    EngineConfig,
    SchedulerConfig,
    resolve_dtype,
)
from kv8.models.registry import arch_config
from kv8.options import OptionGroup, from_config, option
from kv8.platform import DEVICE_CHOICES, Platform
from kv8.quant.formats import resolve_kv_cache_dtypes
from kv8.validators import check_choice, parse_memory

DEFAULT_MODEL = "smollm2-135m"
logger = logging.getLogger("kv8")


def _memory_size(text: str) -> str:
    """argparse type of memory sizes: checks the syntax now and keeps the string (parsed again by the config)."""
    try:
        parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class _ModelArg(argparse.Action):
    """The model of a command that takes it positionally or as a flag (:meth:`EngineArgs.add_model_arg`): the one
    given, or an error naming both when two different ones are."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = getattr(namespace, "_model_given", None)
        if given is not None and given != values:
            parser.error(f"two models given: {given!r} and {values!r}; give one (positionally, or with "
                         f"{'/'.join(self.option_strings) or 'MODEL'})")
        namespace._model_given = values
        namespace.model = values


@dataclass
class EngineArgs(OptionGroup):
    """Engine options (vLLM's names). Construct freely; :meth:`create_engine_config` validates."""

    cli_group_title = "engine options (EngineArgs; LLM(...) takes the same names)"

    model: str = option(DEFAULT_MODEL, "model: an alias (smollm2-135m), a Hugging Face model directory or a "
                        ".gguf file", cli=False)
    dtype: str = option("auto", "compute dtype; auto = bfloat16", choices=DTYPE_CHOICES, type=str.lower)
    device: str = option("auto", "where the weights, activations and KV cache live: auto = cuda when torch sees a "
                         "GPU, else cpu", choices=DEVICE_CHOICES, type=str.lower)
    load_format: str = from_config(EngineConfig, "load_format")
    enforce_eager: bool = from_config(EngineConfig, "enforce_eager")
    kv_cache_dtype: str = from_config(CacheConfig, "kv_cache_dtype")
    quantization_param_path: str | None = from_config(CacheConfig, "quantization_param_path")
    kv_cache_memory: int | str | None = from_config(CacheConfig, "kv_cache_memory", type=_memory_size)
    gpu_memory_utilization: float = from_config(CacheConfig, "gpu_memory_utilization")
    num_kv_blocks: int | None = from_config(CacheConfig, "num_kv_blocks")
    block_size: int = from_config(CacheConfig, "block_size")
    enable_prefix_caching: bool = from_config(CacheConfig, "enable_prefix_caching")
    max_num_seqs: int = from_config(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = from_config(SchedulerConfig, "max_num_batched_tokens")
    max_model_len: int | None = option(
        None, f"context length (default: the model's, at most {DEFAULT_MAX_MODEL_LEN})", type=int)
    seed: int = from_config(EngineConfig, "seed")
    attention_backend: str = from_config(EngineConfig, "attention_backend")
    dense_backend: str = from_config(EngineConfig, "dense_backend")
    quantization: str | None = option(
        None, "how the decoder's linear layers hold their weights: unset = the checkpoint's form (a quantized GGUF "
        "file's blocks kept, as gguf, on the CPU in bfloat16 with kv8's kernels; otherwise as loaded); none = as "
        "loaded, in the compute dtype (a GGUF file's blocks dequantized at load); fp8 = E4M3 codes with one float32 "
        "scale per output row (half the bytes a decode step reads; the LM head and embedding stay as loaded); gguf = "
        "keep a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K / Q6_K blocks as they are, the embedding's and LM head's "
        "too, multiplied by an int8-activation kernel (a Q4 model's weights in ~1/3.5 of bf16's bytes)",
        choices=QUANTIZATION_CHOICES)
    kv_cache_scale_mode: str = from_config(CacheConfig, "kv_cache_scale_mode")
    kv_cache_rotation: str = from_config(CacheConfig, "kv_cache_rotation")
    kv_cache_dtype_skip_layers: str | Sequence[int | str] = from_config(CacheConfig, "kv_cache_dtype_skip_layers")
    kv_cache_plan: str | None = from_config(CacheConfig, "kv_cache_plan")
    disable_hybrid_kv_cache_manager: bool = from_config(CacheConfig, "disable_hybrid_kv_cache_manager")
    tensor_parallel_size: int = from_config(ParallelConfig, "tensor_parallel_size")
    cpu_threads_per_rank: int | None = from_config(ParallelConfig, "cpu_threads_per_rank")
    adaptive_cpu_threads: bool = from_config(ParallelConfig, "adaptive_cpu_threads")

    # ---- CLI ----------------------------------------------------------------------------------------------------
    @classmethod
    def add_model_arg(cls, parser: argparse.ArgumentParser, *flags: str, optional: bool = False) -> None:
        """The ``model`` argument with the field's help: positional (no ``flags``; required unless
        ``optional``, which gives it the default model), a flag such as ``--model``, or both (``flags`` and
        ``optional``: ``kv8 serve MODEL`` as vLLM's ``vllm serve MODEL``, or ``kv8 serve --model-id MODEL`` as
        TGI's; two different models are an error)."""
        help_text = cls.__dataclass_fields__["model"].metadata["help"]
        with_default = f"{help_text} (default: {DEFAULT_MODEL})"
        if flags and optional:
            parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, action=_ModelArg, metavar="MODEL",
                                help=with_default)
            parser.add_argument(*flags, dest="model", default=DEFAULT_MODEL, action=_ModelArg, metavar="MODEL",
                                help="the model, as a flag (instead of the positional MODEL)")
        elif flags:
            parser.add_argument(*flags, dest="model", default=DEFAULT_MODEL, help=with_default)
        elif optional:
            parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=with_default)
        else:
            parser.add_argument("model", help=help_text)

    # ---- validation ---------------------------------------------------------------------------------------------
    def weight_quantization(self, model_kind: str, model_path: str,
                            platform: Platform | None = None) -> tuple[str | None, bool]:
        """The quantization the engine runs (``None``: the weights as loaded) and whether it was chosen for the
        model rather than given: ``quantization`` unset means :func:`default_quantization`'s choice on ``platform``
        (default: ``device`` resolved), ``"none"`` as loaded. ``ValueError`` for a value not in
        :data:`~kv8.engine.config.QUANTIZATION_CHOICES`."""
        check_choice("quantization", self.quantization, QUANTIZATION_CHOICES, optional=True,
                     hint="(or leave it unset for the checkpoint's own form)")
        if self.quantization is not None:
            return (None if self.quantization == "none" else self.quantization), False
        platform = platform if platform is not None else Platform.resolve(self.device)
        chosen = default_quantization(model_kind, model_path, resolve_dtype(self.dtype), platform, self.dense_backend,
                                      self.load_format, self.tensor_parallel_size)
        return chosen, chosen is not None

    def create_engine_config(self, hf_config: dict, model_kind: str, model_path: str) -> EngineConfig:
        """Convert and validate every option against the model's architecture (``ValueError`` if one is bad)."""
        arch = arch_config(hf_config)
        dtype = resolve_dtype(self.dtype)
        cache = CacheConfig(
            kv_dtype=resolve_kv_cache_dtypes(self.kv_cache_dtype, dtype)[0], kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            kv_cache_memory=None if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory),
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_kv_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
            quantization_param_path=self.quantization_param_path, kv_cache_scale_mode=self.kv_cache_scale_mode,
            kv_cache_rotation=self.kv_cache_rotation,
            kv_cache_dtype_skip_layers=_skip_layers(self.kv_cache_dtype_skip_layers),
            kv_cache_plan=self.kv_cache_plan,
            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager)
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = default_max_model_len(arch.max_position_embeddings)
        sched = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=self.max_num_seqs,
                                max_num_batched_tokens=self.max_num_batched_tokens)
        platform = Platform.resolve(self.device)
        quantization, auto = self.weight_quantization(model_kind, model_path, platform)
        if auto:
            logger.info("weights: %s keeps its GGUF blocks (quantization='gguf', the default for a quantized GGUF "
                        "file on the CPU; quantization='none' dequantizes them at load)", model_path)
        return EngineConfig(model=model_path, model_kind=model_kind, arch=arch, dtype=dtype, cache=cache,
                            scheduler=sched, seed=self.seed, attention_backend=self.attention_backend,
                            dense_backend=self.dense_backend, quantization=quantization, quantization_auto=auto,
                            parallel=ParallelConfig(self.tensor_parallel_size, self.cpu_threads_per_rank,
                                                    self.adaptive_cpu_threads),
                            platform=platform, load_format=self.load_format,
                            enforce_eager=self.enforce_eager)


def default_quantization(model_kind: str, model_path: str, dtype: torch.dtype, platform: Platform,
                         dense_backend: str, load_format: str, tensor_parallel_size: int) -> str | None:
    """The weights' quantization when none is given: ``"gguf"`` for a GGUF file with decoder weights of a type kv8's
    kernels read as blocks (:func:`kv8.loader.model.keeps_gguf_blocks`), run on the CPU in bfloat16 by those kernels
    (``dense_backend`` auto or packed_bf16, and they load), with one tensor-parallel rank and the file's weights
    (``load_format="auto"``) -- as vLLM and llama.cpp run a GGUF file's blocks; ``None`` (the weights as loaded)
    otherwise. Under tensor parallelism ``quantization="gguf"`` is given explicitly (a shape that does not split on
    block boundaries fails at load, where dequantized weights would split anywhere)."""
    if (model_kind != "gguf" or platform.kind != "cpu" or dtype != torch.bfloat16 or load_format != "auto"
            or tensor_parallel_size != 1 or dense_backend not in ("auto", "packed_bf16")):
        return None
    from kv8.kernels.cpu.build import KernelUnavailable
    from kv8.layers.dense_backend import select_dense_backend
    from kv8.loader.model import keeps_gguf_blocks

    if not keeps_gguf_blocks(model_kind, model_path):
        return None
    try:
        kernels = select_dense_backend(dense_backend, dtype, "gguf", platform).kernels
    except KernelUnavailable:   # packed_bf16 whose kernels do not load: the engine's dense backend says why
        return None
    return "gguf" if kernels is not None else None


def _skip_layers(value: str | Iterable[int | str] | None) -> tuple[int | str, ...]:
    """``kv_cache_dtype_skip_layers`` as a tuple: "1,sliding_window" or [1, "sliding_window"] -> (1,
    "sliding_window"); digits become layer indices (validated by :class:`CacheConfig`)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[int | str] = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            out.append(int(item) if item.isdigit() else item)
        else:
            out.append(item)
    return tuple(out)


__all__ = ["DEFAULT_MODEL", "EngineArgs"]
