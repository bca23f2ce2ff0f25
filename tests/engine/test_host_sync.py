"""No host sync in a decode step (issue 39, item 3), checked on the CPU.

On CUDA every read of a device tensor on the host (``.item()``, ``.tolist()``, ``int(t)``, ``float(t)``,
``bool(t)``, ``.cpu()``, ``.numpy()``) waits for the device. The step's code path is the same on CPU tensors, so
here :class:`SyncCounter` (a ``TorchFunctionMode``) counts those calls made from kv8's own code during one
engine step, on the GPU path's pieces: the triton attention backend (in Triton's interpreter, whose own reads are
not kv8's and not counted), the CUDA-graph buffers (run eagerly) or an eager forward, and a runner whose platform
says host reads wait (so the sampler takes the branch CUDA takes). A decode step makes one read: the step's
results, packed in one ``.tolist()``. (Before this check the same step made one per sampled sequence and more.)

The host-to-device copies of a step are checked apart: page-locked sources, ``non_blocking=True``. On a machine
with a GPU, the last test asks torch itself (``torch.cuda.set_sync_debug_mode``) to count a decode step's
synchronizations; it has not run yet (no GPU where it was written, 2026-11-28).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import kv8
from kv8 import LLM, SamplingParams
from kv8.engine.cuda_graphs import DecodeGraphs
from kv8.engine.sampler import make_generator, sample
from kv8.platform import Platform

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

SYNCING = frozenset({"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"})
KV8_DIR = os.path.dirname(os.path.abspath(kv8.__file__))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class SyncCounter(TorchFunctionMode):
    """Records each call of a method in :data:`SYNCING` on a tensor, made from a file of the kv8 package (the
    first frame outside torch), as ``"name at path:line"``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING and args and isinstance(args[0], torch.Tensor):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(KV8_DIR):
                where = os.path.relpath(frame.f_code.co_filename, KV8_DIR)
                self.calls.append(f"{name} at {where}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


class _HostReadsSync(Platform):
    """The CPU, with the sampler's CUDA branch: a host read is taken to wait for the device."""

    @property
    def host_reads_sync(self) -> bool:
        return True


HOST_READS_SYNC = _HostReadsSync("cpu")

PROMPTS = ["The quick brown fox jumps over", "Paris is the capital of", "Once upon", "A B C D E F G",
           "one two three", "Berlin is"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),                               # greedy
    SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=2, max_tokens=6, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, min_p=0.05, top_k=100, seed=3, max_tokens=6, ignore_eos=True,
                   repetition_penalty=1.2, frequency_penalty=0.1, logit_bias={5: 2.0}, min_tokens=4),
    SamplingParams(temperature=0.7, top_p=0.8, seed=4, max_tokens=6, ignore_eos=True),         # top-p alone
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1),                 # greedy, logprobs
]


@pytest.mark.parametrize("graphs", [True, False], ids=["graph-buffers", "eager"])
def test_a_decode_step_reads_the_device_once(tiny_llama, graphs):
    llm = LLM(model=tiny_llama, dtype="float32", attention_backend="triton", max_model_len=128,
              kv_cache_memory="4MiB", kv_cache_dtype="fp8_e4m3", max_num_seqs=8)
    engine = llm.engine
    runner = engine.runner
    runner.platform = HOST_READS_SYNC
    if graphs:
        runner.enable_decode_graphs(max_num_seqs=8, max_model_len=128, capture=False)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(prompt, params, request_id=str(i))
    engine.step()   # the prefill of every prompt
    for _ in range(3):
        with SyncCounter() as counter:
            outputs = engine.step()
        assert all(c.num_new_tokens == 1 for c in engine._last_schedule.chunks), "not a pure decode step"
        assert len(engine._last_schedule.chunks) == len(PROMPTS) and len(outputs) == len(PROMPTS)
        assert [c.split(" at ")[0] for c in counter.calls] == ["tolist"], counter.calls
    if graphs:
        assert runner.graphs.replays == 3
    engine.shutdown()


def test_sampling_reads_nothing_back_where_reads_wait():
    """The sampler on its own: with top-p / min-p rows that only candidates bound (a vocabulary of 4096), the
    CPU reads back whether their candidates closed (free there); where reads wait, those rows take the full sort
    instead and nothing is read. Both give the same tokens."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4096, generator=gen) * 3.0
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.0, min_p=0.1, seed=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=30, seed=3, logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02, seed=4, repetition_penalty=1.3)]
    histories = [None, None, None, None, _history()]
    tokens = {}
    for platform in (Platform.cpu(), HOST_READS_SYNC):
        generators = [make_generator(p.seed or 0, torch.Generator()) for p in params]
        with SyncCounter() as counter:
            out = sample(logits, params, generators, histories, finite_checked=True, platform=platform)
        tokens[platform.host_reads_sync] = out.token_ids.tolist()
        if platform.host_reads_sync:
            assert counter.calls == []
        else:
            assert [c.split(" at ")[0] for c in counter.calls] == ["tolist"], counter.calls
    assert tokens[True] == tokens[False]


def _history():
    from kv8.engine.sampler import TokenHistory

    return TokenHistory([1, 2, 3], [4, 4])


def test_decode_graph_inputs_are_copied_from_pinned_memory_without_waiting(monkeypatch):
    """DecodeGraphs.run on a CUDA platform (CPU tensors stand in, page-locking is recorded instead of done): each
    of its five inputs per KV cache group comes from a page-locked host tensor by a non-blocking copy."""
    pinned: set[int] = set()

    def pin(t: torch.Tensor) -> torch.Tensor:
        pinned.add(t.data_ptr())
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    copies: list[tuple[bool, bool]] = []

    class CopyRecorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "copy_":
                copies.append((args[1].data_ptr() in pinned, bool(kwargs.get("non_blocking", False))))
            return func(*args, **kwargs)

    from kv8.cache.layout import KVCacheLayout

    layout = KVCacheLayout.build([None, 8], hybrid=True)   # two KV cache groups: full attention and a window
    graphs = DecodeGraphs(lambda ids, pos, metas: ids.float().unsqueeze(1), layout, 4, 4, 32, torch.device("cpu"),
                          capture=False, platform=Platform.cuda((9, 0)))
    with CopyRecorder():
        hidden = graphs.run([7, 8, 9], [4, 0, 9], [5, 1, 10], [[[1, 2], [3], [4, 5, 6]], [[1, 2], [3], [4, 5, 6]]])
    assert hidden.squeeze(1).tolist() == [7.0, 8.0, 9.0]
    assert len(copies) == 2 + 3 * len(layout.groups) and all(p and nb for p, nb in copies), copies


def test_the_cuda_platform_copies_from_pinned_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    cuda = Platform.cuda((9, 0))
    assert cuda.host_tensor([1, 2], torch.int64).tolist() == [1, 2] and calls == ["pin"]
    assert cuda.to_device([3.0], torch.float32, torch.device("cpu")).tolist() == [3.0] and calls == ["pin"] * 2
    assert Platform.cpu().host_tensor([1], torch.int64).tolist() == [1] and calls == ["pin"] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (on the CPU the tests above check the "
                    "step's code path)")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_a_cuda_decode_step_synchronizes_once(tiny_llama, enforce_eager):
    """On a GPU, torch's own count: ``torch.cuda.set_sync_debug_mode("warn")`` warns at every synchronizing CUDA
    call; a decode step makes one (its read-back)."""
    import warnings

    llm = LLM(model=tiny_llama, dtype="bfloat16", device="cuda", max_model_len=128, kv_cache_memory="16MiB",
              kv_cache_dtype="fp8_e4m3", max_num_seqs=8, enforce_eager=enforce_eager)
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(prompt, params, request_id=str(i))
    engine.step()   # the prefill
    engine.step()   # a first decode step: pinned host blocks allocated, kernels compiled
    torch.cuda.synchronize()
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert all(c.num_new_tokens == 1 for c in engine._last_schedule.chunks)
        syncs = [str(w.message) for w in caught if "synchronizing" in str(w.message)]
        assert len(syncs) == 1, syncs
    engine.shutdown()
