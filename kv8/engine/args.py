"""User-facing engine options with vLLM's names, declared once and turned into a validated :class:`EngineConfig`.

Each field of :class:`EngineArgs` is one option. Its default, help text, allowed values and CLI flag are the
field's declaration (:func:`option`); the allowed values are the tuples that :mod:`kv8.config` and
:mod:`kv8.quant.formats` check against. Everything else is generated from the fields:

* ``LLM(**kwargs)`` takes the fields as keyword arguments;
* :meth:`EngineArgs.add_cli_args` adds one flag per field to an argparse parser (``--kv-cache-dtype`` ...;
  booleans as ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``) and
  :meth:`EngineArgs.from_cli_args` reads them back, so every ``kv8`` subcommand shares the same flags;
* :meth:`EngineArgs.describe` prints the table of options.

Values are checked in one place: :meth:`EngineArgs.create_engine_config` converts them (dtype names,
memory sizes) and the frozen dataclasses of :mod:`kv8.config` validate them, raising ``ValueError`` naming
the field, the value and what is allowed. The CLI's ``choices`` and types only make argparse report a bad
flag earlier, with the same allowed values.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kv8.cache.layout import KVCacheLayout, pool_block_bytes, split_budget
from kv8.config import (
    ATTENTION_BACKENDS,
    DENSE_BACKENDS,
    DTYPE_CHOICES,
    QUANTIZATION_METHODS,
    ROTATIONS,
    SCALE_MODES,
    CacheConfig,
    EngineConfig,
    ModelArchConfig,
    ParallelConfig,
    SchedulerConfig,
    default_kv_cache_memory,
    format_bytes,
    parse_memory,
    resolve_dtype,
)
from kv8.quant.formats import KV_CACHE_DTYPE_NAMES, resolve_kv_cache_dtype

DEFAULT_MODEL = "smollm2-135m"


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


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           type: Callable[[str], Any] | None = str, metavar: str | None = None, cli: bool = True) -> Any:
    """A field of :class:`EngineArgs`: its default plus what the CLI and :meth:`EngineArgs.describe` need.

    ``type`` converts the flag's text (``bool`` makes a ``--x`` / ``--no-x`` pair); ``choices`` is the tuple
    that declares the allowed values; ``cli=False`` marks a field each command declares itself (the model,
    which is positional for some commands).
    """
    return field(default=default, metadata={"help": help, "choices": choices, "type": type, "metavar": metavar,
                                            "cli": cli})


@dataclass
class EngineArgs:
    """Engine options (vLLM's names). Construct freely; :meth:`create_engine_config` validates."""

    model: str = option(DEFAULT_MODEL, "model: an alias (smollm2-135m), a Hugging Face model directory or a "
                        ".gguf file", cli=False)
    dtype: str = option("auto", "compute dtype; auto = bfloat16", choices=DTYPE_CHOICES, type=str.lower)
    kv_cache_dtype: str = option("auto", "KV cache storage: auto = the compute dtype; fp8 = fp8_e4m3 (1 byte per "
                                 "value)", choices=KV_CACHE_DTYPE_NAMES)
    quantization_param_path: str | None = option(
        None, "KV scales file: vLLM's kv_cache_scales.json or kv8's JSON from kv8 calibrate (FP8 caches only)",
        metavar="JSON")
    kv_cache_memory: int | str | None = option(
        None, "KV cache budget: bytes or a size such as 2GiB (default: 25% of free memory, at most 4GiB)",
        type=_memory_size, metavar="SIZE")
    num_kv_blocks: int | None = option(None, "KV cache budget in blocks instead of bytes", type=int)
    block_size: int = option(16, "tokens per KV block (a power of two)", type=int)
    enable_prefix_caching: bool = option(True, "reuse cached KV blocks of shared prompt prefixes", type=bool)
    max_num_seqs: int = option(64, "max sequences per step", type=int)
    max_num_batched_tokens: int = option(2048, "max tokens per step (longer prompts are prefilled in chunks)",
                                         type=int)
    max_model_len: int | None = option(None, "context length (default: the model's, at most 8192)", type=int)
    seed: int = option(0, "engine seed for requests without their own", type=int)
    attention_backend: str = option(
        "auto", "attention: auto = cpu_fused (kv8's fused CPU kernels) if they build, else reference (plain torch)",
        choices=ATTENTION_BACKENDS)
    dense_backend: str = option(
        "auto", "linear layers, norms, activation, RoPE: auto = packed_bf16 (kv8's packed AVX-512 BF16 kernels) "
        "for bfloat16 models if they build, else torch", choices=DENSE_BACKENDS)
    quantization: str | None = option(
        None, "quantize the weights of the decoder's linear layers at load: fp8 = E4M3 codes with one float32 "
        "scale per output row (half the bytes a decode step reads; the LM head and embedding stay as loaded)",
        choices=QUANTIZATION_METHODS)
    kv_cache_scale_mode: str = option(
        "static", "FP8 scales: static per layer (file, checkpoint or 1.0) or dynamic per token and head "
        "(no calibration; +4 bytes per token, head and K/V)", choices=SCALE_MODES)
    kv_cache_rotation: str = option(
        "none", "rotate K/V by a per-head Hadamard matrix before storing (more accurate FP8)", choices=ROTATIONS)
    kv_cache_dtype_skip_layers: str | list[int | str] | None = option(
        None, "layers kept in the compute dtype in an FP8 cache: comma-separated layer indices and/or "
        "'sliding_window' (every sliding-window layer) or 'full_attention'", metavar="LAYERS")
    disable_hybrid_kv_cache_manager: bool = option(
        False, "keep every block of sliding-window layers instead of freeing those that leave the window",
        type=bool)
    tensor_parallel_size: int = option(
        1, "ranks (processes) the model is split over, Megatron style; each rank's KV cache holds its KV heads "
        "(kv_cache_memory is per rank). Under torchrun, the world size", type=int)
    cpu_threads_per_rank: int | None = option(
        None, "torch threads of each tensor-parallel rank (default: the cores divided among the ranks)", type=int)
    adaptive_cpu_threads: bool = option(
        True, "give parallel regions only the cores other processes leave free (measured twice a second), so that "
        "kv8's spinning OpenMP threads do not collapse beside other busy work; off: always all threads (one-rank "
        "engines; tensor-parallel ranks keep theirs)", type=bool)

    @staticmethod
    def field_names() -> list[str]:
        return [f.name for f in fields(EngineArgs)]

    # ---- CLI ----------------------------------------------------------------------------------------------------
    @staticmethod
    def flag(name: str) -> str:
        """The CLI flag of field ``name``: ``kv_cache_dtype`` -> ``--kv-cache-dtype``."""
        return "--" + name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, include: Iterable[str] | None = None,
                     exclude: Iterable[str] = (), defaults: Mapping[str, Any] | None = None
                     ) -> argparse._ArgumentGroup:
        """Add one flag per field (those in ``include`` if given, less ``exclude``) to an "engine" group.

        ``defaults`` overrides a field's default for this parser (a command that needs another default says
        so here, in one place). Fields declared with ``cli=False`` (the model) are left to the command.
        Returns the argument group.
        """
        by_name = {f.name: f for f in fields(cls)}
        chosen = set(by_name) if include is None else set(include)
        excluded = set(exclude)
        defaults = dict(defaults or {})
        unknown = (chosen | excluded | set(defaults)) - set(by_name)
        if unknown:
            raise ValueError(f"not EngineArgs fields: {', '.join(sorted(unknown))}")
        if set(defaults) & excluded or set(defaults) - chosen:
            raise ValueError(f"defaults {sorted(defaults)} name fields this parser does not offer")
        group = parser.add_argument_group("engine options (EngineArgs; LLM(...) takes the same names)")
        for name, f in by_name.items():
            if name not in chosen or name in excluded or not f.metadata["cli"]:
                continue
            default = defaults.get(name, f.default)
            choices, kind = f.metadata["choices"], f.metadata["type"]
            if choices is not None and default is not None and default not in choices:
                raise ValueError(f"default {name}={default!r} is not one of: {', '.join(choices)}")
            help_text = f.metadata["help"].replace("%", "%%") + ("" if default is None else " (default: %(default)s)")
            kwargs: dict[str, Any] = dict(dest=name, default=default, help=help_text)
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs.update(type=kind, choices=choices, metavar=f.metadata["metavar"])
            group.add_argument(cls.flag(name), **kwargs)
        return group

    @classmethod
    def add_model_arg(cls, parser: argparse.ArgumentParser, *flags: str, optional: bool = False) -> None:
        """The ``model`` argument with the field's help: positional (no ``flags``; required unless
        ``optional``, which gives it the default model), a flag such as ``--model``, or both (``flags`` and
        ``optional``: ``kv8 serve MODEL`` as vLLM's ``vllm serve MODEL``, or ``kv8 serve --model-id MODEL`` as
        TGI's; giving two different models is an error, read by :meth:`resolve_model_arg`)."""
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

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """The fields the namespace has (flags from :meth:`add_cli_args`, and ``model``); others keep defaults."""
        return cls(**{name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)})

    @classmethod
    def describe(cls) -> str:
        """A table of every option: name, CLI flag, default, allowed values and help."""
        lines = ["EngineArgs options (LLM(name=value), or the kv8 flag):"]
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            flag = cls.flag(f.name) if f.metadata["cli"] else "(given by each command)"
            if f.metadata["type"] is bool:
                flag = flag.replace("--", "--[no-]", 1)
            lines.append(f"  {f.name:<24} {flag:<34} default {default!r}")
            lines.append(f"      {f.metadata['help']}")
            if f.metadata["choices"]:
                lines.append(f"      one of: {', '.join(f.metadata['choices'])}")
        return "\n".join(lines)

    # ---- validation ---------------------------------------------------------------------------------------------
    def create_engine_config(self, hf_config: dict, model_kind: str, model_path: str) -> EngineConfig:
        """Convert and validate every option against the model's architecture (``ValueError`` if one is bad)."""
        arch = ModelArchConfig.from_hf_config(hf_config)
        dtype = resolve_dtype(self.dtype)
        kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype)
        if self.quantization_param_path is not None and not kv_dtype.is_fp8:   # name the value the user set
            shown = repr(self.kv_cache_dtype) + (f" (the {kv_dtype.name} compute dtype)"
                                                 if self.kv_cache_dtype == "auto" else "")
            raise ValueError(f"quantization_param_path={self.quantization_param_path!r} gives FP8 KV scales, but "
                             f"kv_cache_dtype={shown} is not an FP8 format; set kv_cache_dtype='fp8' (or "
                             "fp8_e4m3 / fp8_e4m3fnuz / fp8_e5m2) or drop quantization_param_path")
        memory = None if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory)
        cache = CacheConfig(kv_dtype=kv_dtype, block_size=self.block_size, kv_cache_memory=memory,
                            num_kv_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
                            quantization_param_path=self.quantization_param_path,
                            scale_mode=self.kv_cache_scale_mode, rotation=self.kv_cache_rotation,
                            skip_layers=_skip_layers(self.kv_cache_dtype_skip_layers),
                            hybrid=not self.disable_hybrid_kv_cache_manager)
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(arch.max_position_embeddings, 8192)
        sched = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                max_model_len=max_model_len)
        return EngineConfig(model=model_path, model_kind=model_kind, arch=arch, dtype=dtype, cache=cache,
                            scheduler=sched, seed=self.seed, attention_backend=self.attention_backend,
                            dense_backend=self.dense_backend, quantization=self.quantization,
                            parallel=ParallelConfig(self.tensor_parallel_size, self.cpu_threads_per_rank,
                                                            self.adaptive_cpu_threads))


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


def free_memory() -> int | None:
    """Bytes of memory this process may still take: ``MemAvailable`` (/proc/meminfo), lowered to what the cgroup
    v2 memory limit leaves; None where neither can be read (then no check is made)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _budget_option(config: EngineConfig, num_blocks: int) -> str:
    cc = config.cache
    if cc.num_kv_blocks is not None:
        return f"num_kv_blocks={num_blocks} (--num-kv-blocks)"
    if cc.kv_cache_memory is not None:
        return f"kv_cache_memory={format_bytes(cc.kv_cache_memory)} (--kv-cache-memory)"
    return f"the default kv_cache_memory ({format_bytes(default_kv_cache_memory())})"


def check_cache_fits_memory(config: EngineConfig, layout: KVCacheLayout, num_blocks: Sequence[int]) -> None:
    """Raise ``ValueError`` naming the option that sized the cache when the pools of ``layout`` (``num_blocks[p]``
    blocks of pool ``p``) need more memory than is free now. The engine calls it once the weights are loaded (they take
    memory too, and a config whose sizes do not match the checkpoint is reported by the loader first) and before
    the cache is allocated."""
    need = sum(n * b for n, b in zip(num_blocks, pool_block_bytes(config, layout)))
    free = free_memory()
    if free is not None and need > free:
        raise ValueError(
            f"{_budget_option(config, sum(num_blocks))} asks for a KV cache of {format_bytes(need)}, but only "
            f"{format_bytes(free)} of memory is free on this machine (the model's weights loaded); lower it")


def resolve_num_blocks(config: EngineConfig, layout: KVCacheLayout) -> list[int]:
    """Blocks of each pool of ``layout`` for the configured budget; raises ``ValueError`` naming the option that
    set it if a pool cannot hold what one ``max_model_len`` sequence needs in it (sliding-window groups counted at
    their window). (Whether they fit in free memory: :func:`check_cache_fits_memory`.)"""
    cc, sched = config.cache, config.scheduler
    block_bytes = pool_block_bytes(config, layout)
    chunk = min(sched.max_num_batched_tokens, sched.max_model_len)
    needs = [layout.blocks_per_sequence(p.pool_id, sched.max_model_len, cc.block_size, chunk) for p in layout.pools]
    if cc.num_kv_blocks is not None:
        if len(layout.pools) > 1:
            raise ValueError("num_kv_blocks cannot size a cache with layers in two dtypes "
                             "(kv_cache_dtype_skip_layers); give kv_cache_memory instead")
        num_blocks = [cc.num_kv_blocks]
        fix = f"raise num_kv_blocks to at least {needs[0]}, or lower max_model_len"
    else:
        memory = cc.kv_cache_memory if cc.kv_cache_memory is not None else default_kv_cache_memory()
        num_blocks = split_budget(memory, layout, block_bytes, sched.max_model_len, cc.block_size, chunk)
        fix = (f"raise kv_cache_memory (needs at least {format_bytes(sum(b * k for b, k in zip(block_bytes, needs)))})"
               " or lower max_model_len")
    for p, n, need in zip(layout.pools, num_blocks, needs):
        if n < need:
            stored = "the compute dtype" if p.skipped else cc.kv_dtype.name
            raise ValueError(
                f"the KV cache of {_budget_option(config, sum(num_blocks))} has {n} blocks of {cc.block_size} tokens "
                f"({format_bytes(block_bytes[p.pool_id])} each in {stored}), fewer than max_model_len="
                f"{sched.max_model_len} needs ({need} blocks for one sequence); {fix}")
    return num_blocks


__all__ = ["DEFAULT_MODEL", "EngineArgs", "check_cache_fits_memory", "free_memory", "option",
           "resolve_num_blocks"]
