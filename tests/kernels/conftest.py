"""Fixtures of the attention kernels' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv8.kernels.cpu.attention import KernelLibrary
from tests.helpers.kernels import amx_path


@pytest.fixture(params=["amx", "avx512"])
def kernel_path(request: pytest.FixtureRequest, lib: KernelLibrary) -> Iterator[str]:
    """Each path of the prefill loop and the decode-item kernel in turn: AMX tiles (only where this CPU, build
    and OS give them) and AVX-512 (vdpbf16ps), set on the library (KernelLibrary.amx) for the test. ``lib`` is the
    requesting module's fixture: the attention library it tests."""
    with amx_path(lib, request.param) as path:
        yield path
