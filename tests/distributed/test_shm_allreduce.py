"""The shared-memory all-reduce of tensor-parallel ranks on one machine, against the plain sum.

Ranks are real processes (spawn) mapping one file, as kv8's launcher starts them; more ranks than this machine's
cores, so waits must yield. The oracle is the float32 sum of every rank's tensor in rank order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from kv8.distributed.shm_allreduce import ShmAllReduce, create_shm_file

SIZES = [(1, 8), (4, 96), (7, 33), (16, 96), (3, 5)]
SLOT = 16 * 96 * 4


def _tensor(rank: int, call: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _rank_main(rank: int, size: int, path: str, dtype_name: str, calls: int, out: mp.Queue) -> None:
    dtype = getattr(torch, dtype_name)
    ar = ShmAllReduce(path, rank, size, SLOT, 30.0, lambda: None)
    results = []
    for call in range(calls):
        x = _tensor(rank, call, SIZES[call % len(SIZES)], dtype)
        y = ar.all_reduce(x)
        results.append((str(y.dtype), tuple(y.shape), y.float().tolist()))   # exact: bf16 and f32 fit f32
    out.put((rank, results))


@pytest.mark.parametrize("size,dtype", [(2, "float32"), (3, "bfloat16"), (4, "float32")])
def test_every_rank_gets_the_rank_order_sum(size: int, dtype: str) -> None:
    """Many calls of changing shapes (the two alternating slots are reused over and over): each rank's result
    equals the float32 sum in rank order (rounded once to the dtype), bit for bit, on every rank."""
    ctx = mp.get_context("spawn")
    path = create_shm_file(size, SLOT)
    out: mp.Queue = ctx.Queue()
    calls = 40
    procs = [ctx.Process(target=_rank_main, args=(r, size, path, dtype, calls, out)) for r in range(size)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in range(size))
    for p in procs:
        p.join(30)
    os.unlink(path)
    assert all(p.exitcode == 0 for p in procs)
    dt = getattr(torch, dtype)
    for call in range(calls):
        shape = SIZES[call % len(SIZES)]
        want = _tensor(0, call, shape, dt).float()
        for r in range(1, size):
            want = want + _tensor(r, call, shape, dt).float()
        for r in range(size):
            dtype_name, got_shape, values = got[r][call]
            assert dtype_name == str(dt) and got_shape == shape
            assert torch.equal(torch.tensor(values), want.to(dt).float()), (call, r)


def test_a_rank_that_never_comes_is_reported_by_alive_and_by_the_timeout(tmp_path) -> None:
    path = create_shm_file(2, SLOT)
    try:
        gone = ShmAllReduce(path, 0, 2, SLOT, 30.0, lambda: "tensor-parallel rank 1 (exit code -9) exited")
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(exit code -9\) exited \(shared-memory all-reduce 1"):
            gone.all_reduce(torch.ones(4))
        assert time.monotonic() - start < 2.0
        late = ShmAllReduce(path, 0, 2, SLOT, 0.5, lambda: None)
        with pytest.raises(RuntimeError, match=r"ranks \[1\] did not arrive within 0 s"):
            late.all_reduce(torch.ones(4))
    finally:
        os.unlink(path)


def test_slots_and_sizes() -> None:
    path = create_shm_file(2, 64)
    try:
        ar = ShmAllReduce(path, 0, 2, 64, 1.0, lambda: None)
        assert ar.fits(torch.zeros(16)) and not ar.fits(torch.zeros(17))
        with pytest.raises(ValueError, match="slot_bytes must be a positive multiple of 8, got 12"):
            ShmAllReduce(path, 0, 2, 12, 1.0, lambda: None)
    finally:
        os.unlink(path)


def test_the_shared_memory_path_is_for_x86_64_only() -> None:
    """Its flags rely on x86-64's total store order (no fences): other machines sum through gloo."""
    from kv8.distributed.shm_allreduce import supported

    assert supported("x86_64") and supported("AMD64")
    assert not supported("aarch64") and not supported("ppc64le") and not supported("riscv64")
