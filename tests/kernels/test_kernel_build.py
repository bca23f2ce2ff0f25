"""kv8's native kernels build wherever this machine can build them.

The kernel tests skip where a library is unavailable (no compiler, a CPU without the instructions), so a
compile error in the C++ sources would otherwise turn the attention and dense tests into skips and pass. Here
it fails: with ``g++`` on PATH the attention library must load on any x86-64 CPU (its generic path needs no
AVX-512), with the fast path exactly where the CPU has AVX-512 F/BW/VL + VBMI + BF16, and the dense library
must load where the CPU has AVX-512 F/BW + VBMI + BF16 (its "avx512" path) or else AVX2 + FMA + F16C ("avx2"); a
build for a plain x86-64-v2 target has neither, and says so.
"""

from __future__ import annotations

import ctypes
import platform
import shutil

import pytest

from kv8.kernels.cpu.attention import load_kernels
from kv8.kernels.cpu.build import KernelUnavailable, build_shared_library, cpu_flags
from kv8.kernels.cpu.dense import (
    SOURCE,
    ArgmaxCall,
    GGUFDequantizeCall,
    GGUFLinearCall,
    GGUFPackCall,
    LinearCall,
    RmsNormCall,
    RopeCall,
    SiluMulCall,
    load_dense_kernels,
)

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"),
                               reason="no g++ on PATH or not x86-64: kv8 runs its torch paths here")


@needs_gxx
def test_kernels_build_where_the_machine_can() -> None:
    flags = set(cpu_flags().split())
    lib = load_kernels()  # raises KernelUnavailable, with the compiler's message, where the build fails
    assert lib.has_fast_path == ({"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_bf16"} <= flags)
    assert not lib.amx or "amx_bf16" in flags
    if {"avx512f", "avx512bw", "avx512vbmi", "avx512_bf16"} <= flags:
        dense = load_dense_kernels()
        assert dense.isa == "avx512"
        assert not dense.amx or "amx_bf16" in flags
    elif {"avx2", "fma", "f16c"} <= flags:
        dense = load_dense_kernels()
        assert dense.isa == "avx2" and not dense.amx


@needs_gxx
def test_the_dense_library_of_each_target_says_which_path_it_has() -> None:
    """x86-64-v3 (AVX2 + FMA + F16C) builds the AVX2 path; x86-64-v2 builds neither: the library still loads as a file,
    says "none", every kernel entry returns ERR_NO_FAST_PATH, and load_dense_kernels raises KernelUnavailable."""
    if {"avx2", "fma", "f16c"} <= set(cpu_flags().split()):
        assert load_dense_kernels("x86-64-v3").isa == "avx2"
    raw = ctypes.CDLL(str(build_shared_library(SOURCE, "x86-64-v2")))
    raw.kv8_dense_isa.restype = ctypes.c_char_p
    assert raw.kv8_dense_isa() == b"none" and raw.kv8_linear_available() == 0
    raw.kv8_error_message.restype = ctypes.c_char_p
    entries = {"kv8_linear": LinearCall, "kv8_linear_fp8": LinearCall, "kv8_rmsnorm": RmsNormCall,
               "kv8_silu_mul": SiluMulCall, "kv8_rope_qkv": RopeCall, "kv8_argmax_rows": ArgmaxCall}
    for entry, struct in entries.items():
        call = struct()
        call.rows, call.num_threads = 1, 1   # arguments a kernel would take (an empty batch returns OK first)
        rc = getattr(raw, entry)(ctypes.byref(call))
        assert rc == 7 and b"has no AVX-512 BF16 + VBMI path" in raw.kv8_error_message(rc)   # ERR_NO_FAST_PATH
    # the GGUF entries (csrc/dense/gguf.h) check their arguments, then have no path: every type, Q4_K's K too
    raw.kv8_gguf_type_name.restype = ctypes.c_char_p
    assert raw.kv8_gguf_linear_available() == 0 and raw.kv8_gguf_type_name(3) == b"Q4_K"
    buf = ctypes.create_string_buffer(1024)
    linear = GGUFLinearCall(ctypes.addressof(buf), ctypes.addressof(buf), None, ctypes.addressof(buf), 1, 256, 1, 3, 1)
    assert raw.kv8_gguf_linear(ctypes.byref(linear)) == 7
    linear.in_features = 32   # not a multiple of Q4_K's 256
    assert raw.kv8_gguf_linear(ctypes.byref(linear)) == 5   # ERR_ARGS
    dequantize = GGUFDequantizeCall(ctypes.addressof(buf), ctypes.addressof(buf), 1, 256, 3, 1)
    assert raw.kv8_gguf_dequantize(ctypes.byref(dequantize)) == 7
    pack = GGUFPackCall(ctypes.addressof(buf), ctypes.addressof(buf), 1, 256, 0, 1, 3, 0, 1)
    assert raw.kv8_gguf_dequantize_packed(ctypes.byref(pack)) == 7
    pack.panels = 2   # past the one panel of a one-row matrix
    assert raw.kv8_gguf_dequantize_packed(ctypes.byref(pack)) == 5
    with pytest.raises(KernelUnavailable, match="neither AVX-512 BF16 \\+ VBMI nor AVX2 \\+ FMA \\+ F16C"):
        load_dense_kernels("x86-64-v2")


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
        monkeypatch.setattr(dense, "_LOADED", {})
        monkeypatch.setattr(dense, "_FAILED", {})
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
