"""``benchmarks/gpu_check.py`` at its smoke shapes, on the CPU through Triton's interpreter: the script a GPU runs
once in a while works before it gets there. The numbers mean nothing here; the shapes of its results and what
they must satisfy do (every row timed, the fp8 cache holding twice the bf16 sequences in one budget, the blocks
returned: the script asserts it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.paths import ROOT


def test_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--skip", "tests",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and "tests" not in result and result["copy_GBps"] > 0
    assert [(r["batch"], r["context"]) for r in result["attention"]] == [(1, 64), (2, 48)]
    for row in result["attention"]:
        for name in ("fp8_e4m3", "bfloat16", "sdpa"):
            assert row[name]["us"] > 0 and row[name]["gbps"] > 0
    engine = result["engine"]
    assert [r["kv"] for r in engine["at_batch"]] == ["bfloat16", "fp8_e4m3"]
    bf16, fp8 = engine["at_max_batch"]
    assert (bf16["batch"], fp8["batch"]) == (3, 6)   # one budget: an fp8 cache holds twice the sequences
    assert fp8["kv_capacity_tokens"] == 2 * bf16["kv_capacity_tokens"]
    for row in engine["at_batch"] + engine["at_max_batch"]:
        assert row["decode_tokens"] == row["batch"] * row["decode_steps"] and row["tok_s"] > 0
    assert "fp8 / bf16 KV decode tok/s" in proc.stdout


def test_refuses_to_run_on_the_cpu_outside_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA GPU: run with TRITON_INTERPRET=1" in proc.stderr
