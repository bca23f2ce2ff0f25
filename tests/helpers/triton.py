"""Where the tests of kv8's Triton kernels run them: compiled on CUDA tensors where there is a GPU, else in Triton's
interpreter on CPU tensors (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` then, before any kernel is
decorated)."""

from __future__ import annotations

import triton

INTERPRETED = bool(triton.knobs.runtime.interpret)
DEVICES = ["cpu"] if INTERPRETED else ["cuda"]   # the one device this process runs the kernels on


def on_device(kwargs: dict) -> dict:
    """``kwargs`` with every CPU tensor moved to the device this process runs the kernels on (``DEVICES[0]``), the
    rest as they are (a tensor placed on another device on purpose stays there): argument checks written with CPU
    tensors then reach the check they test on a GPU too, not the kernels' refusal of CPU tensors."""
    import torch

    return {k: v.to(DEVICES[0]) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
            for k, v in kwargs.items()}
