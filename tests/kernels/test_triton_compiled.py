"""The GPU kernels' compiled code, checked without a GPU (issue 39, item 2).

:mod:`tests.helpers.sm90` builds the launches the wrappers make for one layer of Llama-3.1-8B (32 query heads, 8 KV
heads, head_dim 128, blocks of 16; decode: 32 sequences at 4k context; prefill: one 2048-token prompt; fp8_e4m3
with static per-head scales and bf16 caches, bf16 queries; and the decode and the store over an int8 cache, with
its per-token scales) and compiles them for sm_90 with Triton's compiler and
the ptxas/cuobjdump its wheel ships, in a subprocess without ``TRITON_INTERPRET``. The figures (registers, spills,
shared memory, the key loop's ``cp.async.wait_group`` counts, conversions and instructions per KB of cache) are
printed (``pytest -s``) so a change shows its effect, and :func:`tests.helpers.sm90.violations` says which of the
design's promises they break. docs/benchmarks.md lists the figures; timings on a GPU are owed. The same launches
for an MI300X (gfx942, E4M3FNUZ) compile with Triton's HIP backend, checked by :mod:`tests.helpers.gfx942`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import gfx942, sm90

# The same launches compiled from commit f501a9f (before issue 39): one buffer per K/V tile (wait_group 0), 16-key
# FP8 tiles converted through float16 to bfloat16 with scalar F2F, 4 and 8 warps. Figures of tests.helpers.sm90.
_OLD_FIGURES = {
    "decode-fp8_e4m3": {"registers": 126, "spill_bytes": 0, "shared_bytes": 8708, "num_warps": 4, "num_stages": 3,
                        "TILE_N": 16, "wait_groups": [0], "cvt_fp8_packed": ["cvt.rn.f16x2.e4m3x2"],
                        "cvt_fp8_scalar": [], "loop_sass": 380, "loop_f2f": 48, "instr_per_kb": 380.0},
    "decode-bfloat16": {"registers": 90, "spill_bytes": 0, "shared_bytes": 12804, "num_warps": 4, "num_stages": 3,
                        "TILE_N": 16, "wait_groups": [0], "cvt_fp8_packed": [], "cvt_fp8_scalar": [],
                        "loop_sass": 219, "loop_f2f": 0, "instr_per_kb": 109.5},
    "prefill-fp8_e4m3": {"registers": 124, "spill_bytes": 0, "shared_bytes": 24580, "num_warps": 8, "num_stages": 3,
                         "TILE_N": 16, "wait_groups": [0], "cvt_fp8_packed": ["cvt.rn.f16x2.e4m3x2"],
                         "cvt_fp8_scalar": [], "loop_sass": 302, "loop_f2f": 16, "instr_per_kb": 604.0},
    "prefill-bfloat16": {"registers": 117, "spill_bytes": 0, "shared_bytes": 32772, "num_warps": 8, "num_stages": 3,
                         "TILE_N": 16, "wait_groups": [0], "cvt_fp8_packed": [], "cvt_fp8_scalar": [],
                         "loop_sass": 271, "loop_f2f": 0, "instr_per_kb": 271.0},
    "store-fp8_e4m3": {"registers": 72, "spill_bytes": 0, "shared_bytes": 2048},
    "store-bfloat16": {"registers": 26, "spill_bytes": 0, "shared_bytes": 0},
}

# The same launches compiled from commit b46a915 (pipelined; FP8 decode tiles of 16 query rows x 64 keys over 2
# warps, keys the products' columns), the figures violations() reads.
_PACKED = ["cvt.rn.f16x2.e4m3x2"]
_B46A915_FIGURES: dict[str, dict[str, Any]] = {
    name: {"spill_bytes": 0, "cvt_fp8_scalar": [], "loop_f2f": 0, "registers": regs, "shared_bytes": shared,
           "num_warps": warps, "wait_groups": [wait], "cvt_fp8_packed": _PACKED if "fp8" in name else [],
           "instr_per_kb": per_kb}
    for name, regs, shared, warps, wait, per_kb in (
        ("decode-fp8_e4m3", 230, 55808, 2, 3, 97.2), ("decode-bfloat16", 128, 20488, 1, 3, 52.4),
        ("prefill-fp8_e4m3", 237, 66560, 4, 4, 191.2), ("prefill-bfloat16", 182, 66048, 4, 4, 128.2),
        ("decode-int8", 245, 40448, 2, 5, 219.0))}


def _compiled_rows(tmp_path: Path, tool: ModuleType, *args: str) -> dict[str, Any]:
    """The figures ``python -m <tool> *args`` prints for the kernels it compiles (``tool``: :mod:`tests.helpers.sm90`
    or :mod:`tests.helpers.gfx942`, run without Triton's interpreter, its compile cache under ``tmp_path``): the
    table is printed (``pytest -s``), the JSON rows returned. Skips where the tool's compilers are missing."""
    missing = tool.tools_missing()
    if missing:
        pytest.skip(missing)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", tool.__name__, *args], env=env, capture_output=True, text=True,
                         timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    print("\n".join(lines[:-1]))          # the table (pytest -s)
    rows: dict[str, Any] = json.loads(lines[-1])
    return rows


def test_the_promises_fail_on_the_old_kernels() -> None:
    """Each promise of :func:`sm90.violations` can fail: the old kernels' figures break the pipelining, conversion
    and per-KB promises; b46a915's break the per-KB one only (which, as "at most twice bf16's", they kept); a
    spilling variant (FP8 decode with 32-key tiles, 4 warps, 5 stages, measured while choosing the configuration)
    and 8 warps of 255 registers break the others."""
    bad = sm90.violations(_OLD_FIGURES)
    assert sum("not pipelined" in b for b in bad) == 4, bad
    assert any(b.startswith("decode-fp8_e4m3: 48 scalar F2F") for b in bad), bad
    assert any(b.startswith("prefill-fp8_e4m3: 16 scalar F2F") for b in bad), bad
    assert any("FP8 loop 380.0 instructions per KB > bf16's 109.5" in b for b in bad), bad
    assert not any("spills" in b or "per SM" in b for b in bad), bad
    worse = json.loads(json.dumps(_OLD_FIGURES))
    worse["decode-fp8_e4m3"].update(spill_bytes=8, registers=128)
    worse["decode-bfloat16"].update(registers=255, num_warps=8)
    worse["prefill-fp8_e4m3"].update(cvt_fp8_packed=[], cvt_fp8_scalar=["cvt.f32.e4m3"])
    bad = sm90.violations(worse)
    assert any(b.startswith("decode-fp8_e4m3: 8 bytes of register spills") for b in bad), bad
    assert any(b.startswith("decode-bfloat16:") and "per SM" in b for b in bad), bad
    assert any(b.startswith("prefill-fp8_e4m3: FP8 conversions ['cvt.f32.e4m3']") for b in bad), bad
    # commit b46a915's kernels keep every promise but the per-KB one: FP8 decode cheaper per key, not per KB
    assert sm90.violations(_B46A915_FIGURES) == ["decode: FP8 loop 97.2 instructions per KB > bf16's 52.4"]


def test_kernels_compiled_for_sm90_keep_their_promises(tmp_path: Path) -> None:
    """Decode, prefill and store kernels at Llama-3.1-8B shapes, compiled for an H100 as the wrappers launch them:
    no spills, pipelined key loops, packed native FP8 conversion, FP8 decode no dearer per KB than bf16, room for
    4 decode programs per SM (:func:`sm90.violations`; the int8 decode keeps all but the FP8 ones)."""
    rows = _compiled_rows(tmp_path, sm90)
    assert set(rows) == set(_OLD_FIGURES) | {"decode-int8", "store-int8"}
    assert sm90.violations(rows) == []


def test_fp4_kernels_compiled_for_sm90_do_not_spill(tmp_path: Path) -> None:
    """fp4_e2m1's decode and prefill attention and its store at Llama-3.1-8B shapes, compiled for an H100 as the
    wrappers launch them (Triton's binder sees the real strides: rows of 64 code bytes and 8 E4M3 scale codes, 72
    bytes): no register spills, no FP8 conversion instruction (codes and scales are decoded by bits). The figures
    are printed (``pytest -s``); what they show beyond the assertions: the decode takes 4 warps of 64 keys (as
    int4's and int4_per_group32's) and ~210-220 registers (the group formats' launches lift ptxas's cap of 168,
    where it spills with Triton 3.7.1 and 3.9), so 2 programs per SM by registers rather than the 4 that
    :func:`sm90.violations` asks of the FP8, bf16 and int8 decodes; the key loops copy the 72-byte rows (8-byte
    aligned, which the launch tells the kernel: ``ROW_ALIGN``) 8 bytes a thread by ``cp.async``, pipelined."""
    rows = _compiled_rows(tmp_path, sm90, "fp4_e2m1")
    assert set(rows) == {"decode-fp4_e2m1", "prefill-fp4_e2m1", "store-fp4_e2m1"}
    for name, r in rows.items():
        assert r["spill_bytes"] == 0 and r["registers"] <= 255, (name, r)
        if not name.startswith("store-"):
            assert r["cvt_fp8_packed"] == [] and r["cvt_fp8_scalar"] == [] and r["loop_mma"] > 0, (name, r)


def test_group_format_decode_loads_are_vectorised_and_pipelined(tmp_path: Path) -> None:
    """int4_per_group32's and fp4_e2m1's decode attention at Llama-3.1-8B shapes (rows of 64 code bytes and 8 scale
    bytes, 72: not 16-byte multiples), compiled for an H100 as the wrappers launch them: the launch derives that
    every row starts at a multiple of 8 bytes (``ROW_ALIGN``, :func:`kv8.kernels.triton.attention.row_alignment`)
    and the kernel tells Triton, so the key loop's code bytes are copied 8 bytes a thread by ``cp.async`` and
    pipelined (``cp.async.wait_group`` above 0), at most 1.5 times int4_per_token_head's SASS instructions per KB
    (int4's 32-byte-aligned rows), with no register spills. Without the hint (commit d75ffcf) the loops are not
    pipelined (no ``cp.async``): 1006.2 and 1300.9 instructions per KB against int4's 551.0 (Triton 3.6)."""
    rows = _compiled_rows(tmp_path, sm90, "--decode", "int4", "int4_per_group32", "fp4_e2m1")
    int4 = rows["decode-int4"]["instr_per_kb"]
    for kv in ("int4_per_group32", "fp4_e2m1"):
        r = rows[f"decode-{kv}"]
        assert r["spill_bytes"] == 0 and r["registers"] <= 255, (kv, r)
        assert r["wait_groups"] and max(r["wait_groups"]) > 0, (kv, r["wait_groups"])
        assert max(r["async_copy_bytes"], default=0) >= 8, (kv, r["async_copy_bytes"])
        assert r["instr_per_kb"] <= 1.5 * int4, (kv, r["instr_per_kb"], int4)


def test_k8v4_kernels_compiled_for_sm90_do_not_spill(tmp_path: Path) -> None:
    """A cache of two formats, int8 K (dynamic per-token scales) and int4_per_group32 V ("k8v4"), at Llama-3.1-8B
    shapes compiled for an H100 as the wrappers launch them: the decode and prefill attention (each tile decoded by
    its side's format) and the store (int8's dynamic scales and int4_per_group32's scale search in one launch) spill
    no registers, and the attention's key loops are pipelined, copying V's 72-byte rows (8-byte aligned) at least 8
    bytes a thread. The figures are printed (``pytest -s``; docs/benchmarks.md lists them beside int8's and
    int4_per_group32's)."""
    rows = _compiled_rows(tmp_path, sm90, "k8v4")
    assert set(rows) == {"decode-k8v4", "prefill-k8v4", "store-k8v4"}
    for name, r in rows.items():
        assert r["spill_bytes"] == 0 and r["registers"] <= 255, (name, r)
        if not name.startswith("store-"):
            assert r["wait_groups"] and max(r["wait_groups"]) > 0, (name, r["wait_groups"])
            assert max(r["async_copy_bytes"], default=0) >= 8, (name, r["async_copy_bytes"])


def test_float32_query_decode_does_not_spill(tmp_path: Path) -> None:
    """Float32 queries (float32 products on CUDA cores, 16 x 16 tiles) at Llama-3.1-8B decode shapes over every
    cache format, compiled for an H100 as the wrappers launch them: 8 warps (launch_config), no register spills (on
    4 warps, commit d75ffcf, they spill 448-660 bytes with Triton 3.6)."""
    kvs = ["fp8_e4m3", "int8", "int4", "int4_per_group32", "fp4_e2m1", "bfloat16"]
    rows = _compiled_rows(tmp_path, sm90, "--decode-f32", *kvs)
    assert set(rows) == {f"decode-{kv}" for kv in kvs}
    for name, r in rows.items():
        assert r["spill_bytes"] == 0 and r["num_warps"] == 8, (name, r)


def test_kernels_compiled_for_gfx942_keep_their_promises(tmp_path: Path) -> None:
    """Decode and prefill attention over E4M3FNUZ (the format MI300 converts in hardware) and bf16, and the FP8
    store, compiled for an MI300X (gfx942) by Triton's HIP backend, which needs neither ROCm nor a GPU: no spills to
    memory, LDS within 64 KB, E4M3FNUZ decoded by ``v_cvt_pk_f32_fp8`` where the MI300 platform picks the native
    path (:func:`tests.helpers.gfx942.violations`). The figures (registers, occupancy, LDS) are printed."""
    rows = _compiled_rows(tmp_path, gfx942)
    assert set(rows) == {"decode-fp8_e4m3fnuz", "decode-bfloat16", "prefill-fp8_e4m3fnuz", "prefill-bfloat16",
                         "store-fp8_e4m3fnuz"}
    assert gfx942.violations(rows) == []


def test_the_gfx942_promises_can_fail() -> None:
    """Each promise of :func:`gfx942.violations` fails on figures that break it."""
    base = {"native_fp8": True, "TILE_N": 64, "vgprs": 224, "sgprs": 89, "occupancy": 2, "vgpr_spills": 0,
            "sgpr_spills": 0, "scratch_bytes": 0, "lds_bytes": 49408, "num_warps": 2, "num_stages": 5,
            "cvt_fp8": ["v_cvt_pk_f32_fp8_e32"]}
    assert gfx942.violations({"decode-fp8_e4m3fnuz": base}) == []
    bad = gfx942.violations({
        "decode-fp8_e4m3fnuz": {**base, "native_fp8": False, "cvt_fp8": []},
        "prefill-fp8_e4m3fnuz": {**base, "scratch_bytes": 16, "vgpr_spills": 4},
        "decode-bfloat16": {**base, "native_fp8": False, "lds_bytes": 70000, "cvt_fp8": ["v_cvt_pk_f32_fp8_e32"]}})
    assert any(b.startswith("decode-fp8_e4m3fnuz: native False") for b in bad), bad
    assert any(b.startswith("prefill-fp8_e4m3fnuz: 4 VGPR spills, 16 bytes of scratch") for b in bad), bad
    assert any(b.startswith("decode-bfloat16: 70000 bytes of LDS") for b in bad), bad
    assert any(b.startswith("decode-bfloat16: FP8 conversions") for b in bad), bad
