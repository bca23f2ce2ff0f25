"""``benchmarks/bench_profile.py``: its per-family clock (self time, nested calls, hooks removed afterwards) on toy
modules, and one ``--quick`` run of the real tool on SmolLM2-135M (tables, values, JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn

from tests.helpers.paths import ROOT, load_file_module


def load_bench() -> ModuleType:
    if str(ROOT / "benchmarks") not in sys.path:   # as when it runs as a script: it imports benchmarks/engine_steps.py
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return load_file_module(ROOT / "benchmarks" / "bench_profile.py")


bench = load_bench()


class Sleeper(nn.Module):
    """Sleeps ``seconds``, then calls ``inner`` (if any)."""

    def __init__(self, seconds: float, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.seconds, self.inner = seconds, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x if self.inner is None else self.inner(x)


def test_nested_calls_get_their_own_family_and_nothing_is_counted_twice():
    timer = bench.FamilyTimer()
    inner = Sleeper(0.010)
    outer = Sleeper(0.020, inner)
    handles = timer.add_hooks(outer, "linear") + timer.add_hooks(inner, "activation")
    start = time.perf_counter()
    outer(torch.zeros(1))
    wall = time.perf_counter() - start
    for h in handles:
        h.remove()
    s = timer.seconds
    assert s["activation"] >= 0.010 and s["linear"] >= 0.020   # each its own sleep: the inner one is not hidden
    assert s["linear"] + s["activation"] <= wall                 # ... nor counted twice
    assert s["linear"] + s["activation"] > wall - 0.005
    assert timer.calls == {**dict.fromkeys(bench.FAMILIES, 0), "linear": 1, "activation": 1}
    assert timer.nested["linear"] == 1 and timer.nested["activation"] == 0
    timer.reset()   # nothing left open


def test_hooked_times_the_families_and_leaves_nothing_behind():
    from kv8.engine import runner as runner_module
    from kv8.layers.dense_backend import TORCH_BACKEND
    from kv8.layers.norm import RMSNorm

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(8, 1e-6, TORCH_BACKEND)
            self.norm.weight.data.fill_(1.0)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden.float()

    toy, sample = Toy(), runner_module.sample
    timer = bench.FamilyTimer()
    with bench.hooked(SimpleNamespace(model=toy), timer):
        x = torch.ones(2, 8)
        toy.norm(x)
        toy.compute_logits(x)
        assert runner_module.sample is not sample
    assert timer.calls["norm"] == 1 and timer.calls["lm_head"] == 1
    assert timer.seconds["norm"] > 0 and timer.seconds["lm_head"] > 0
    assert runner_module.sample is sample
    assert "compute_logits" not in toy.__dict__
    assert not toy.norm._forward_pre_hooks and not toy.norm._forward_hooks


def test_calibrated_hook_cost_is_small_and_positive():
    cost = bench.calibrate(calls=200, repeats=3)
    assert 0 < cost.inside < 1e-3 and 0 <= cost.outside < 1e-3


def table(out: str, kind: str) -> tuple[list[str], dict[str, float]]:
    """The ms table of step ``kind`` (one configuration): its columns and the row's values."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(kind + ":"))
    header = lines[at + 1].split()
    assert header[0] == "configuration"
    columns = header[1:]
    values = [float(v) for v in lines[at + 2].split()[-len(columns):]]
    return columns, dict(zip(columns, values))


@pytest.mark.slow
def test_quick_run(tmp_path: Path):
    out_json = tmp_path / "profile.json"
    # one thread: on a machine shared with other work, spinning OpenMP threads would make the run crawl
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_profile.py"), "--quick", "--rounds", "1",
           "--config", "--kv-cache-dtype fp8_e4m3 --dense-backend torch_fp32", "--threads", "1",
           "--json", str(out_json)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("machine: ") and " kv8 " in out
    assert "dense backend torch_fp32, attention backend " in out

    kinds = ["prefill 1 x 128", "decode B=1 @ 64", "decode B=4 @ 64"]
    doc = json.loads(out_json.read_text())
    (config,) = doc["configs"]
    assert config["dense_backend"] == "torch_fp32" and config["attention_backend"]
    assert list(config["steps"]) == kinds
    for kind in kinds:
        columns, row = table(out, kind)
        assert columns == [*bench.FAMILIES, "rest", "step", "plain", "hooks"]
        for family in bench.FAMILIES:   # every family runs in every step (the prefill samples its last token)
            assert row[family] > 0, (kind, family, row)
        assert row["rest"] >= 0 and row["plain"] > 0, (kind, row)
        families = sum(row[f] for f in bench.FAMILIES)
        assert families <= row["step"], (kind, row)
        assert families + row["rest"] == pytest.approx(row["step"], abs=0.05)   # two decimals per cell
        summary = config["steps"][kind]["summary"]
        for column, value in row.items():
            assert summary[column]["median"] == pytest.approx(value, abs=0.006)
        assert config["steps"][kind]["timed_calls"][0] > 30 * 8   # 30 layers x 9 modules, the rest
