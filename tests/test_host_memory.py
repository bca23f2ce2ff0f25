"""kv8.host_memory: freed activations are reused (no fresh page faults per step) once an engine process tunes glibc's
malloc, and an explicit user setting is left alone (each case in its own interpreter: the settings are
process-wide). With KV8_HUGE_PAGES=1 the loaded weights sit in memory advised for 2 MiB pages, which the kernel
grants where transparent huge pages are enabled, with contents, shapes and tied parameters unchanged; off by
default; the KV cache stays on ordinary pages."""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from torch import nn

from kv8 import envs
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.host_memory import HUGE_PAGE, huge_page_bytes, huge_page_empty, place_on_huge_pages, release_free_heap
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.scales import KVScales
from tests.helpers.host_memory import thp_mode

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

# A step's pattern: five activations of 8 MiB allocated and written, then all freed (40 MiB free at the top of
# the heap, more than glibc's default trim threshold, which its dynamic mmap threshold raises to 16 MiB here);
# 20 rounds. Reports the minor faults of the last 10 rounds and what tune_malloc said. Mode "default" pins glibc's
# starting mmap threshold (128 KiB) instead, so that the baseline does not depend on how its dynamic threshold and
# the heap's top happened to move.
PROBE = """
import json, resource, sys, torch
from kv8.host_memory import tune_malloc
if sys.argv[1] == "tune":
    said = tune_malloc()
else:
    import ctypes
    from kv8.host_memory import M_MMAP_THRESHOLD
    said = "default" if ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1 else "mallopt failed"
def rounds(n):
    for _ in range(n):
        held = [torch.empty(2048, 2048, dtype=torch.bfloat16).fill_(1.0) for _ in range(5)]
        del held
rounds(10)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(10)
print(json.dumps({"said": said, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without glibc's malloc variables, plus ``extra``."""
    return {**envs.without_malloc_settings(), **extra}


def probe(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=clean_env(**env), capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuned_process_reuses_freed_activations():
    pages = 2048 * 2048 * 2 // 4096   # one tensor's pages: 2,048
    untuned, tuned = probe("default"), probe("tune")
    assert (untuned["said"], tuned["said"]) == ("default", "set")
    assert untuned["faults"] >= 5 * pages, untuned   # glibc's defaults: fresh pages every round
    assert tuned["faults"] < pages // 4, tuned        # tuned: the freed block is reused


@pytest.mark.parametrize("env, name", [({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
                                       ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_")])
def test_user_malloc_settings_win(env, name):
    result = probe("tune", **env)
    assert result["said"] == f"left to {name}"
    assert result["faults"] >= 5 * (2048 * 2048 * 2 // 4096)   # their settings (smaller thresholds) stand


def test_engine_process_is_tuned(tiny_llama):
    code = (f"from kv8 import LLM\nfrom kv8.host_memory import tune_malloc\n"
            f"LLM(model={tiny_llama!r}, kv_cache_dtype='fp8', num_kv_blocks=64)\n"
            f"print(tune_malloc.cache_info().currsize, tune_malloc())")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True,
                         timeout=300)
    assert out.stdout.split()[-2:] == ["1", "set"], out.stdout + out.stderr


# A load's pattern under tune_malloc: 40 transient 8 MiB copies (below its 32 MiB mmap threshold: in the heap), each
# followed by a 1 MiB weight that stays, then the copies freed: 320 MiB of holes below kept memory, which no trim
# threshold returns. Reports the resident MiB after the frees and after release_free_heap, and what it returned.
TRIM_PROBE = """
import json, torch
from kv8.host_memory import release_free_heap, tune_malloc
def resident():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) / 1024
tune_malloc()
copies, kept = [], []
for _ in range(40):
    copies.append(torch.ones(8 << 20, dtype=torch.uint8))
    kept.append(torch.ones(1 << 20, dtype=torch.uint8))
del copies
before = resident()
released = release_free_heap()
print(json.dumps({"before": before, "after": resident(), "released": released}))
"""


def test_release_free_heap_returns_holes_between_kept_memory():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], env=clean_env(), capture_output=True, text=True,
                         check=True, timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["released"] and result["before"] - result["after"] > 250, result
    assert isinstance(release_free_heap(), bool)   # in this process too: whatever is free, without raising


@pytest.mark.parametrize("args, needle", [(["--batches", "8,x"], "--batches"), (["--batches", "0"], "--batches"),
                                          (["--rounds", "0"], "--rounds"),
                                          (["--compare", "pages", "--steps", "0"], "--steps"),
                                          (["--compare", "swap"], "--compare")])
def test_bench_host_memory_rejects_bad_arguments(args, needle):
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                         "bench_host_memory.py")
    out = subprocess.run([sys.executable, bench, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


@pytest.fixture
def huge_pages_on(monkeypatch):
    monkeypatch.setenv(envs.HUGE_PAGES_ENV, "1")


def test_huge_page_empty_is_aligned_and_granted_huge_pages(huge_pages_on):
    t = huge_page_empty((3, 1 << 20), torch.bfloat16)
    assert (t.shape, t.dtype, t.is_contiguous()) == ((3, 1 << 20), torch.bfloat16, True)
    assert t.data_ptr() % HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == 3 * (1 << 21) + HUGE_PAGE   # the mapping, with room to align
    assert huge_page_bytes(t.data_ptr()) == 0   # nothing touched yet: no resident memory
    t.fill_(2.0)
    granted = huge_page_bytes(t.data_ptr())
    if thp_mode() in ("always", "madvise"):
        assert granted is not None and granted >= HUGE_PAGE, granted
    else:
        assert not granted
    row = t[2]
    del t
    gc.collect()
    assert row.float().sum().item() == 2.0 * (1 << 20)   # a view keeps the mapping alive


@pytest.mark.parametrize("value", [None, "", "0"])
def test_huge_pages_off_by_default_and_small_tensors_are_plain(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(envs.HUGE_PAGES_ENV, raising=False)
    else:
        monkeypatch.setenv(envs.HUGE_PAGES_ENV, value)
    off = huge_page_empty((4 << 20,), torch.uint8).fill_(1)
    assert off.untyped_storage().nbytes() == 4 << 20   # torch's own allocation, not a mapping of kv8's
    assert place_on_huge_pages(_Tied()) == 0
    monkeypatch.setenv(envs.HUGE_PAGES_ENV, "1")
    small = huge_page_empty((1000, 3), torch.float32)
    assert (small.shape, small.dtype, small.is_contiguous()) == ((1000, 3), torch.float32, True)
    assert huge_page_empty((0, 5), torch.bfloat16).shape == (0, 5)


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_bad_huge_pages_value_is_refused(monkeypatch, value):
    monkeypatch.setenv(envs.HUGE_PAGES_ENV, value)
    with pytest.raises(ValueError, match=rf"KV8_HUGE_PAGES='{value}' is not one of: 0 .*, 1 "):
        huge_page_empty((4 << 20,), torch.uint8)


class _Tied(nn.Module):
    """Parameters over one huge page, a tied pair, a buffer, and two buffers that are views of one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(512, 1024)            # 2 MiB of float32 weight
        self.down = nn.Linear(1024, 512, bias=False)
        self.head = nn.Linear(1024, 512, bias=False)
        self.head.weight = self.down.weight       # tied: one Parameter in two modules
        self.register_buffer("steps", torch.arange(1000, dtype=torch.float64))
        shared = torch.arange(200.0)
        self.register_buffer("lo", shared[:100])
        self.register_buffer("hi", shared[100:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(x)) + self.down(self.up(x))


def test_place_on_huge_pages_moves_tensors_and_keeps_ties(huge_pages_on):
    torch.manual_seed(0)
    m = _Tied()
    x = torch.randn(3, 512)
    want = m(x)
    before = {name: t.clone() for name, t in [*m.named_parameters(), *m.named_buffers()]}
    views = (m.lo.data_ptr(), m.hi.data_ptr())
    moved = place_on_huge_pages(m)
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in (m.up.weight, m.up.bias, m.down.weight, m.steps)]
    assert moved == sum(sizes)
    starts = [t.data_ptr() for t in (m.up.weight, m.up.bias, m.down.weight, m.steps)]
    base = min(starts)
    assert base % HUGE_PAGE == 0 and all(base <= p < base + moved for p in starts)
    assert m.head.weight is m.down.weight
    assert (m.lo.data_ptr(), m.hi.data_ptr()) == views   # views of a larger storage stay where they are
    for name, t in [*m.named_parameters(), *m.named_buffers()]:
        assert torch.equal(t, before[name]), name
    assert torch.equal(m(x), want)


def test_place_on_huge_pages_leaves_small_modules_and_off(monkeypatch):
    monkeypatch.setenv(envs.HUGE_PAGES_ENV, "1")
    assert place_on_huge_pages(nn.Linear(64, 64)) == 0   # under one huge page: not worth a mapping
    monkeypatch.setenv(envs.HUGE_PAGES_ENV, "0")
    m = _Tied()
    ptr = m.up.weight.data_ptr()
    assert place_on_huge_pages(m) == 0 and m.up.weight.data_ptr() == ptr


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
def test_kv_cache_stays_on_ordinary_pages(huge_pages_on, kv):
    """The cache is first touched while serving, where fresh 2 MiB pages cost more (kv8.host_memory)."""
    dtype = resolve_kv_cache_dtype(kv, torch.bfloat16)
    codec = KVCodec.build(dtype, 64, scales=KVScales.default(2) if dtype.is_fp8 else None)
    cache = PagedKVCache(CacheShape(2, 512, 4, 16, 64), codec)   # 8 or 16 MiB
    for codes in (cache.k_data, cache.v_data):
        assert codes.shape == (2, 512, 4, 16, 64) and codes.is_contiguous()
        assert codes.untyped_storage().nbytes() == codes.numel() * codes.element_size()   # torch's own
