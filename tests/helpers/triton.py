"""Where the tests of kv8's Triton kernels run them: compiled on CUDA tensors where there is a GPU, else in Triton's
interpreter on CPU tensors (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` then, before any kernel is
decorated)."""

from __future__ import annotations

import triton

INTERPRETED = bool(triton.knobs.runtime.interpret)
DEVICES = ["cpu"] if INTERPRETED else ["cuda"]   # the one device this process runs the kernels on
