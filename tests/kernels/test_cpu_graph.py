"""kv8.kernels.cpu.graph: a recorded forward replays the same kernel calls and torch operators over the same
memory, so after new inputs are written into the tensors it read, a replay equals an eager run bit for bit; what a
replay could not repeat is refused at capture."""

from __future__ import annotations

import pytest
import torch

from kv8.kernels.cpu.build import KernelUnavailable
from kv8.kernels.cpu.dense import load_dense_kernels
from kv8.kernels.cpu.graph import CaptureRefused, CPUGraph

try:
    _KERNELS = load_dense_kernels()
    _WHY = ""
except KernelUnavailable as exc:   # no compiler, or a CPU without AVX2 / AVX-512 BF16
    _KERNELS, _WHY = None, str(exc)
needs_kernels = pytest.mark.skipif(_KERNELS is None, reason=f"kv8's dense kernels are unavailable: {_WHY}")


def _forward(kernels, x, residual, norm_w, packed, n, bias):
    """A decoder-like piece: add + RMSNorm (kernel), a packed linear (kernel), torch operators around them (a
    functional one, an in-place one, views)."""
    h, res = kernels.rmsnorm(x, residual, norm_w, 1e-5)
    y = kernels.linear(h, packed, n, bias)
    y = y.view(y.shape[0], n // 2, 2).transpose(1, 2).reshape(y.shape[0], n)   # views and a copy
    z = torch.tanh(y.float())                                                   # functional
    z.mul_(2.0)                                                                 # in place
    return z + res.float()[:, :1]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
def test_replay_equals_eager_on_new_inputs(rows):
    torch.manual_seed(0)
    k, n = 64, 40
    packed = _KERNELS.pack(torch.randn(n, k).bfloat16())
    bias = torch.randn(n)
    norm_w = torch.randn(k).bfloat16()
    x, residual = torch.randn(rows, k).bfloat16(), torch.randn(rows, k).bfloat16()
    graph = CPUGraph()
    with torch.inference_mode():
        out = graph.capture(lambda: _forward(_KERNELS, x, residual, norm_w, packed, n, bias))
        assert graph.num_kernel_calls == 2 and graph.num_torch_ops >= 3
        for seed in (1, 2):
            torch.manual_seed(seed)
            x.copy_(torch.randn(rows, k))
            residual.copy_(torch.randn(rows, k))
            graph.replay()
            expected = _forward(_KERNELS, x, residual, norm_w, packed, n, bias)
            assert torch.equal(out, expected)


@needs_kernels
def test_replay_reads_the_thread_count_of_its_time():
    packed = _KERNELS.pack(torch.randn(32, 64).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    graph = CPUGraph()
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            graph.capture(lambda: _KERNELS.linear(x, packed, 32, None))
            struct = graph._thread_structs[0]
            assert struct.num_threads == threads
            torch.set_num_threads(1)
            graph.replay()
            assert struct.num_threads == 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("forward, what", [
    (lambda x: x * float(x.sum()), "item|_local_scalar_dense"),   # a value read back by Python
    (lambda x: x[x > 0], "mask"),                               # a shape that depends on values
    (lambda x: x + torch.rand_like(x), "rand"),                 # random
])
def test_capture_refuses_what_a_replay_cannot_repeat(forward, what):
    x = torch.randn(8)
    graph = CPUGraph()
    with torch.inference_mode(), pytest.raises(CaptureRefused, match=what):
        graph.capture(lambda: forward(x))
    assert not graph.captured
    with pytest.raises(RuntimeError, match="not captured"):
        graph.replay()


def test_a_graph_is_captured_once_and_a_capture_is_not_nested():
    graph = CPUGraph()
    x = torch.ones(3)
    graph.capture(lambda: x + 1)
    with pytest.raises(RuntimeError, match="captured already"):
        graph.capture(lambda: x + 1)
    outer = CPUGraph()
    with pytest.raises(RuntimeError, match="already being captured"):
        outer.capture(lambda: CPUGraph().capture(lambda: x + 1))
