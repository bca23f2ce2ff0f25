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


def _attention_kernels():
    from kv8.kernels.cpu.attention import load_kernels

    try:
        return load_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"kv8's attention kernels are unavailable: {exc}")


@needs_kernels
def test_a_failing_call_in_the_middle_of_a_run_raises_its_eager_error_and_stops_the_run():
    """A run mixing both libraries (rmsnorm, store, linear) replayed from C: a slot outside the cache written into
    the static slot mapping makes the store fail; the replay raises the eager ValueError, the rmsnorm before it ran,
    the linear after it did not."""
    from kv8.cache.paged_cache import CacheShape
    from kv8.kernels.cpu.attention import store_kv_fused
    from kv8.quant.formats import resolve_kv_cache_dtype
    from tests.helpers.kernels import make_cache

    attn = _attention_kernels()
    torch.manual_seed(0)
    k, n, heads, dim = 64, 32, 2, 32
    cache = make_cache(CacheShape(1, 4, heads, 16, dim), resolve_kv_cache_dtype("bfloat16", torch.bfloat16), None)
    packed = _KERNELS.pack(torch.randn(n, k).bfloat16())
    norm_w = torch.randn(k).bfloat16()
    x, residual = torch.randn(1, k).bfloat16(), torch.randn(1, k).bfloat16()
    kv = torch.randn(1, heads, dim).bfloat16()
    slots = torch.tensor([3])

    def forward():
        h, res = _KERNELS.rmsnorm(x, residual, norm_w, 1e-5)
        store_kv_fused(attn, cache, 0, kv, kv, slots)
        return h, _KERNELS.linear(h, packed, n, None)

    graph = CPUGraph()
    with torch.inference_mode():
        h, y = graph.capture(forward)
        assert graph.native_runs == [3]
        slots.fill_(cache.shape.num_blocks * cache.shape.block_size)   # one past the last slot
        with pytest.raises(ValueError) as eager:
            forward()
        h.zero_()
        y.zero_()
        x.copy_(torch.randn(1, k))
        with pytest.raises(ValueError) as replayed:
            graph.replay()
        assert str(replayed.value) == str(eager.value) and "slot" in str(replayed.value)
        assert torch.equal(h, _KERNELS.rmsnorm(x, residual, norm_w, 1e-5)[0])   # the call before it was made
        assert not y.any()                                                        # the call after it was not
        slots.fill_(5)
        graph.replay()
        assert torch.equal(y, _KERNELS.linear(h, packed, n, None))


@needs_kernels
def test_runs_of_kernel_calls_split_around_torch_operators():
    torch.manual_seed(0)
    k, n = 64, 40
    packed = _KERNELS.pack(torch.randn(n, k).bfloat16())
    bias = torch.randn(n)
    norm_w = torch.randn(k).bfloat16()
    x, residual = torch.randn(2, k).bfloat16(), torch.randn(2, k).bfloat16()

    def forward():
        h, res = _KERNELS.rmsnorm(x, residual, norm_w, 1e-5)
        h = _KERNELS.linear(_KERNELS.linear(h, packed, n, bias)[:, :k // 2].repeat(1, 2), packed, n, None)
        return torch.tanh(h.float()), res

    graph = CPUGraph()
    with torch.inference_mode():
        out, res = graph.capture(forward)
        assert graph.num_kernel_calls == 3 and graph.native_runs == [2, 1]   # repeat is a torch operator between
        for seed in (1, 2):
            torch.manual_seed(seed)
            x.copy_(torch.randn(2, k))
            residual.copy_(torch.randn(2, k))
            graph.replay()
            expected, expected_res = forward()
            assert torch.equal(out, expected) and torch.equal(res, expected_res)


@needs_kernels
def test_threads_changed_between_replays_reach_every_call_of_a_run():
    torch.manual_seed(0)
    packed = _KERNELS.pack(torch.randn(64, 64).bfloat16())
    norm_w = torch.randn(64).bfloat16()
    x, residual = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()

    def forward():
        h, _ = _KERNELS.rmsnorm(x, residual, norm_w, 1e-5)
        return _KERNELS.linear(_KERNELS.linear(h, packed, 64, None), packed, 64, None)

    threads = torch.get_num_threads()
    graph = CPUGraph()
    try:
        with torch.inference_mode():
            out = graph.capture(forward)
            assert graph.native_runs == [3] and len(graph._thread_structs) == 3
            for count in (1, threads, 1):
                torch.set_num_threads(count)
                x.copy_(torch.randn(3, 64))
                graph.replay()
                assert all(s.num_threads == count for s in graph._thread_structs)
                assert torch.equal(out, forward())
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_a_call_with_more_argument_structs_than_a_replay_takes_is_refused():
    from kv8.kernels.cpu.dense import RmsNormCall

    structs = tuple(RmsNormCall() for _ in range(_KERNELS.CALL_MAX_ARGS + 1))
    graph = CPUGraph()
    with pytest.raises(CaptureRefused, match="argument structs"):
        graph.capture(lambda: graph.record_native(_KERNELS, _KERNELS._lib.kv8_rmsnorm, structs, "a wide call"))
    assert not graph.captured
