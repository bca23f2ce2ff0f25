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


@pytest.mark.parametrize("which", ["dense", "attention"])
def test_a_remembered_failure_keeps_no_callers_frames_alive(which: str, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path) -> None:
    """A library that failed to build is remembered, and every later call raises: a new exception each time. Raising
    the remembered exception object again grew its traceback with each caller's frames, so on a CPU without the
    dense kernels (AVX2) every engine built with dense_backend=auto stayed alive (its cache, its tensor-parallel
    ranks: 'a rank outlived its engine')."""
    import gc
    import weakref

    from kv8.kernels.cpu import attention, dense
    from kv8.kernels.cpu.build import KernelUnavailable

    monkeypatch.setenv("CXX", "kv8-no-such-compiler")
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path))
    if which == "dense":
        monkeypatch.setattr(dense, "_LOADED", [])
        monkeypatch.setattr(dense, "_FAILED", [])
        load = dense.load_dense_kernels
    else:
        monkeypatch.setattr(attention, "_LOADED", {})
        monkeypatch.setattr(attention, "_FAILED", {})
        load = attention.load_kernels

    class Engine:
        pass

    def build_engine() -> weakref.ref:
        engine = Engine()   # a caller's local, as LLMEngine.__init__'s self is
        with pytest.raises(KernelUnavailable, match="kv8-no-such-compiler"):
            load()
        return weakref.ref(engine)

    refs = [build_engine() for _ in range(3)]   # the first call fails to build, the next ones remember it
    gc.collect()
    assert all(r() is None for r in refs)
