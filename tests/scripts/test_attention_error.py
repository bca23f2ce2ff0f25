"""scripts/attention_error.py on the tiny Gemma 3 model (local and global layers, one KV head): a float32 "mode"
changes nothing, E4M3 modes give errors of E4M3's size, and the rotation keeps each vector's round-trip error."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from kv8.cache.codec import KVCodec
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.scales import KVScales
from tests.helpers.paths import ROOT, load_file_module

SCRIPT = ROOT / "scripts" / "attention_error.py"


def _script() -> ModuleType:
    return load_file_module(SCRIPT)


def test_layer_errors_are_zero_for_an_exact_cache_and_e4m3_sized_otherwise() -> None:
    ae = _script()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, h, 32, generator=gen).double() for h in (4, 2, 2))
    exact = KVCodec.build(resolve_kv_cache_dtype("float32", torch.float32), 32)
    zero = ae.layer_errors(q, k, v, 0.2, None, exact, 0)
    assert zero["attn_kl"] == pytest.approx(0.0, abs=1e-12) and zero["out_err"] < 1e-6 and zero["k_err"] < 1e-6
    fp8 = resolve_kv_cache_dtype("fp8_e4m3", torch.float32)
    plain = ae.layer_errors(q, k, v, 0.2, 8, KVCodec.build(fp8, 32, scales=KVScales.default(1)), 0)
    rotated = ae.layer_errors(q, k, v, 0.2, 8, KVCodec.build(fp8, 32, rotation="hadamard",
                                                             scales=KVScales.default(1)), 0)
    for errs in (plain, rotated):
        assert 0.01 < errs["k_err"] < 0.05 and 0.01 < errs["v_err"] < 0.05 and errs["attn_kl"] > 0
    assert rotated["k_err"] == pytest.approx(plain["k_err"], rel=0.2)   # orthonormal: the same size of error


def test_the_script_runs_on_a_model(tiny_models: dict[str, str], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. London is the capital of England. " * 20)
    assert _script().main([tiny_models["gemma3"], "--data", str(text), "--window", "48", "--num-windows", "2",
                           "--modes", "1.0,dynamic+hadamard"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[1] for r in rows] == ["16", "16", "full", "16"]          # the model's local and global layers
    assert all(float(x) > 0 for r in rows for x in r[3:]) and "mean k_err: 1.0 0.0" in out
