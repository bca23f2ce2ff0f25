"""A planned kernel launch: what a wrapper of :mod:`kv8.kernels.triton` passes to one kernel, as a value.

The wrappers (:func:`kv8.kernels.triton.attention.unified_attention`, :func:`kv8.kernels.triton.store.store_kv`)
validate their arguments, plan their launches with the device's properties passed in, and run the plan; a compile
check (tests/helpers/sm90.py) compiles the same plan for a GPU it does not have, so what it measures is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Launch"]


@dataclass(frozen=True)
class Launch:
    """``kernel[grid](*args, **kwargs)``: kwargs hold the constexprs and the compile options (``num_warps``,
    ``num_stages``). ``kernel`` is a ``triton.jit`` function, or its interpreted form under ``TRITON_INTERPRET``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[object, ...]
    kwargs: dict[str, object]

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)
