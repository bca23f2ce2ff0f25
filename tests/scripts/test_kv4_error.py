"""scripts/kv4_error.py: its candidate quantizers (E2M1 rounding against ml_dtypes, group scales) and a run on the
tiny Gemma 3 model."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import ml_dtypes
import numpy as np
import pytest
import torch

from tests.helpers.paths import ROOT, load_file_module

SCRIPT = ROOT / "scripts" / "kv4_error.py"


def _script() -> ModuleType:
    return load_file_module(SCRIPT)


def test_the_candidates_round_like_their_formats() -> None:
    k4 = _script()
    x = np.random.default_rng(0).uniform(-7, 7, 10_000).astype(np.float32)
    want = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(k4.e2m1(torch.from_numpy(x).double()).numpy(), want)
    v = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for name, (fn, bits) in k4.CANDIDATES.items():
        back = fn(v, v.abs().max().item())
        assert back.shape == v.shape and 0 < float((back - v).norm() / v.norm()) < 0.2, name
        assert 4 <= bits(64) <= 5


def test_the_script_runs_on_a_model(tiny_models: dict[str, str], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. London is the capital of England. " * 20)
    assert _script().main([tiny_models["gemma3"], "--data", str(text), "--window", "48", "--num-windows", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:18].strip(): line.split()[-4:] for line in lines[2:]}
    assert len(rows) == 12 and "e2m1/g16 1+H" in rows and "int4/g32" in rows
    assert all(0 < float(r[-1]) < 1 for r in rows.values())
