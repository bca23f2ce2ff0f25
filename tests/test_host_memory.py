"""kv8.host_memory: freed activations are reused (no fresh page faults per step) once an engine process tunes glibc's
malloc, and an explicit user setting is left alone. Each case runs in its own interpreter: the settings are
process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kv8 import envs

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


@pytest.mark.parametrize("args, needle", [(["--batches", "8,x"], "--batches"), (["--batches", "0"], "--batches"),
                                          (["--rounds", "0"], "--rounds")])
def test_bench_host_memory_rejects_bad_arguments(args, needle):
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                         "bench_host_memory.py")
    out = subprocess.run([sys.executable, bench, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and needle in out.stderr, out.stderr
