"""Every environment variable kv8 reads, in one place.

| variable | meaning |
|---|---|
| ``KV8_CACHE_DIR`` | where converted tokenizers and compiled kernels are cached (default ``~/.cache/kv8``) |
| ``CXX`` | the C++ compiler that builds kv8's attention and dense kernels (default ``g++``) |
| ``KV8_API_KEY`` | the server's API key when ``--api-key`` is not given |
| ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` | set by torchrun: this process is one TP rank |
| ``RAY_ADDRESS`` | the Ray cluster of ``kv8 serve --data-parallel-backend ray`` when ``--ray-address`` is not given |
| ``GLIBC_TUNABLES``, ``MALLOC_*_`` | glibc's malloc settings: where set, kv8 keeps them (:mod:`kv8.host_memory`) |
| ``KV8_HUGE_PAGES`` | ``1``: the loaded weights ask for 2 MiB pages; ``0`` or unset (default): ordinary pages |
| ``TRITON_INTERPRET`` | ``1``: Triton runs its kernels in its interpreter, on CPU tensors (tests of the GPU path) |
| ``KV8_TUNING`` | ``auto``/unset: per-machine plans (``kv8.layers.tuning``, ``kv8.attention.tuning``); ``off``: fixed |
| ``KV8_GGUF_KERNEL`` | ``auto``/unset: the GGUF int8 kernel's widest path; ``avx2``, ``vnni256``, ``vnni512``: it |
"""

from __future__ import annotations

import os

CACHE_DIR_ENV = "KV8_CACHE_DIR"
API_KEY_ENV = "KV8_API_KEY"


def cache_dir() -> str:
    """``$KV8_CACHE_DIR`` when set and non-empty, else ``~/.cache/kv8``."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "kv8")


def cxx() -> str:
    """``$CXX`` or ``g++``."""
    return os.environ.get("CXX") or "g++"


def api_key() -> str | None:
    """``$KV8_API_KEY`` when set and non-empty."""
    return os.environ.get(API_KEY_ENV) or None


RAY_ADDRESS_ENV = "RAY_ADDRESS"


def ray_address() -> str | None:
    """``$RAY_ADDRESS`` when set and non-empty (Ray's own variable: an existing cluster to join)."""
    return os.environ.get(RAY_ADDRESS_ENV) or None


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env() -> dict[str, str] | None:
    """torchrun's rendezvous variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when all are
    set, else None (kv8 then starts its tensor-parallel ranks itself)."""
    found = {name: os.environ.get(name) for name in TORCHRUN_VARS}
    return None if any(v is None for v in found.values()) else {k: v for k, v in found.items() if v is not None}


def user_malloc_setting() -> str | None:
    """The variable through which the user set glibc's malloc parameters, if any: ``GLIBC_TUNABLES`` naming a
    ``glibc.malloc`` tunable, or one of glibc's ``MALLOC_*_`` variables (``MALLOC_MMAP_THRESHOLD_``, ...)."""
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return next((name for name in os.environ if name.startswith("MALLOC_") and name.endswith("_")), None)


def without_malloc_settings() -> dict[str, str]:
    """This process's environment without glibc's malloc variables (``GLIBC_TUNABLES``, ``MALLOC_*``): a process
    started with it gets kv8's own malloc settings (:func:`user_malloc_setting` finds none there)."""
    return {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}


HUGE_PAGES_ENV = "KV8_HUGE_PAGES"


def huge_pages() -> bool:
    """``$KV8_HUGE_PAGES``: ``1`` (True), ``0`` or unset/empty (False); any other value is a ValueError."""
    value = os.environ.get(HUGE_PAGES_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{HUGE_PAGES_ENV}={value!r} is not one of: 0 (ordinary pages, the default), 1 (2 MiB pages "
                         "for the weights)")
    return value == "1"


TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


def triton_interpret() -> bool:
    """``$TRITON_INTERPRET`` is set to a true value (Triton's own reading: ``1``, ``true``, ``on``, ``yes``)."""
    return os.environ.get(TRITON_INTERPRET_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


TUNING_ENV = "KV8_TUNING"


def tuning() -> bool:
    """``$KV8_TUNING``: ``auto`` or unset/empty (True: per-machine plans), ``off`` (False); any other value is a
    ValueError."""
    value = os.environ.get(TUNING_ENV, "").strip().lower()
    if value not in ("", "auto", "off"):
        raise ValueError(f"{TUNING_ENV}={value!r} is not one of: auto (time the dense layers' candidates on a "
                         "machine's first run, the default), off (a fixed rule)")
    return value != "off"


GGUF_KERNEL_ENV = "KV8_GGUF_KERNEL"


def gguf_kernel() -> str | None:
    """``$KV8_GGUF_KERNEL``: None for ``auto`` or unset/empty (the widest path the build has), else the path's name
    (``avx2``, ``vnni256``, ``vnni512``), lower-cased; the dense kernels refuse a path their build lacks
    (:attr:`kv8.kernels.cpu.dense.DenseKernels.gguf_path`). Every path computes the same bits: only speed changes."""
    value = os.environ.get(GGUF_KERNEL_ENV, "").strip().lower()
    return None if value in ("", "auto") else value
