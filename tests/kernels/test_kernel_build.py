"""kv8's native kernels build wherever this machine can build them.

The kernel tests skip where a library is unavailable (no compiler, a CPU without the instructions), so a
compile error in the C++ sources would otherwise turn the attention and dense tests into skips and pass. Here
it fails: with ``g++`` on PATH the attention library must load on any x86-64 CPU (its generic path needs no
AVX-512), with the fast path exactly where the CPU has AVX-512 F/BW/VL + VBMI + BF16, and the dense library
must load where the CPU has AVX-512 F/BW + BF16.
"""

from __future__ import annotations

import platform
import shutil

import pytest

from kv8.kernels.cpu.attention import load_kernels
from kv8.kernels.cpu.build import cpu_flags
from kv8.kernels.cpu.dense import load_dense_kernels


def test_kernels_build_where_the_machine_can() -> None:
    if shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no g++ on PATH or not x86-64: kv8 runs its torch paths here")
    flags = set(cpu_flags().split())
    lib = load_kernels()  # raises KernelUnavailable, with the compiler's message, where the build fails
    assert lib.has_fast_path == ({"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_bf16"} <= flags)
    assert not lib.amx or "amx_bf16" in flags
    if {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        dense = load_dense_kernels()
        assert not dense.amx or "amx_bf16" in flags
