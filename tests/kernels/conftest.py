"""Fixtures of the attention kernels' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv8.kernels.cpu.attention import KernelLibrary
from tests.helpers.kernels import amx_path, cpu_has_fast_path, load_or_skip


@pytest.fixture(scope="module")
def lib() -> KernelLibrary:
    """The attention library built for this CPU (-march=native); its fast path compiled exactly where the CPU has
    one."""
    lib = load_or_skip()
    assert lib.has_fast_path == cpu_has_fast_path(), "-march=native must enable the fast path exactly when the CPU can"
    return lib


@pytest.fixture(scope="module", params=["x86-64-v2", "x86-64-v3"])
def portable_lib(request: pytest.FixtureRequest) -> KernelLibrary:
    """A build without AVX-512: x86-64-v2 (SSE4.2) runs the scalar generic kernel everywhere, x86-64-v3 (AVX2 +
    FMA + F16C) the AVX2 kernel."""
    return load_or_skip(request.param)


@pytest.fixture(params=["amx", "avx512"])
def kernel_path(request: pytest.FixtureRequest, lib: KernelLibrary) -> Iterator[str]:
    """Each path of the prefill loop and the decode-item kernel in turn: AMX tiles (only where this CPU, build
    and OS give them) and AVX-512 (vdpbf16ps), set on the library (KernelLibrary.amx) for the test. ``lib`` is the
    library under test (this package's fixture)."""
    with amx_path(lib, request.param) as path:
        yield path
