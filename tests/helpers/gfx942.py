"""Compile kv8's planned Triton launches for an AMD MI300 (gfx942) without one, and read the compiled code.

The AMD row of the seeds: E4M3FNUZ, the format MI300 converts in hardware. Triton's wheel carries its HIP backend
(LLVM's AMDGPU target, the device libraries, the linker inside ``libtriton``), so ``triton.compile`` builds for
``GPUTarget("hip", "gfx942", 64)`` on a machine without ROCm or a GPU. Run as a script in a process without
``TRITON_INTERPRET``::

    python -m tests.helpers.gfx942          # a table of the figures, then the same as JSON

:func:`compile_launch` builds a :class:`kv8.kernels.triton.launch.Launch` as :mod:`tests.helpers.sm90` does (Triton's
own binder, so the launch's specialisations), for gfx942. :func:`measure` reads the kernel's metadata in the AMDGCN
assembly: ``vgprs`` (architectural + accumulation registers per lane), ``sgprs``, ``occupancy`` (waves per SIMD
the registers allow, LLVM's figure), ``vgpr_spills``,
``sgpr_spills`` (to VGPR lanes, not memory), ``scratch_bytes`` (private memory per lane: spills to memory),
``lds_bytes`` (the pipeline buffers) and the FP8 conversion instructions (``v_cvt_pk_f32_fp8``: two E4M3FNUZ codes
to float32 in hardware).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

MI300_LDS_BYTES = 64 * 1024     # the local data share one workgroup may use on gfx942
MI300_COMPUTE_UNITS = 304       # MI300X


def tools_missing() -> str | None:
    """Why this machine cannot compile for gfx942 (None when it can): no Triton or no AMD backend in it."""
    try:
        import triton.backends.amd  # noqa: F401
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
    except ImportError as exc:
        return f"Triton with its AMD backend is not importable: {exc}"
    return None


def compile_launch(launch: Any) -> Any:
    """The launch's kernel compiled for gfx942 (wave 64) as ``launch.run()`` would compile it on an MI300."""
    from tests.helpers.sm90 import compile_for_target

    return compile_for_target(launch, "hip", "gfx942", 64)


@dataclass
class Figures:
    vgprs: int
    sgprs: int
    occupancy: int
    vgpr_spills: int
    sgpr_spills: int
    scratch_bytes: int
    lds_bytes: int
    num_warps: int
    num_stages: int
    cvt_fp8: list[str]


def measure(kernel: Any, num_warps: int, num_stages: int) -> Figures:
    asm = kernel.asm["amdgcn"]

    def field(name: str) -> int:
        found = re.findall(rf"\.{name}:\s+(\d+)", asm)
        if not found:
            raise RuntimeError(f"no .{name} in the kernel's AMDGCN metadata")
        return int(found[-1])

    occupancy = re.findall(r"; Occupancy: (\d+)", asm)
    return Figures(
        vgprs=field("vgpr_count"), sgprs=field("sgpr_count"), occupancy=int(occupancy[-1]) if occupancy else 0,
        vgpr_spills=field("vgpr_spill_count"), sgpr_spills=field("sgpr_spill_count"),
        scratch_bytes=field("private_segment_fixed_size"), lds_bytes=int(kernel.metadata.shared),
        num_warps=num_warps, num_stages=num_stages,
        cvt_fp8=sorted(set(re.findall(r"\bv_cvt\w*_(?:fp8|bf8)\w*", asm))))


# ---- the cases: Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128, blocks of 16) on an MI300X -------

def attention_launch(kv: str, phase: str) -> Any:
    """What :func:`~kv8.kernels.triton.attention.unified_attention` launches for the phase's rows on an MI300X:
    ``kv`` "fp8_e4m3fnuz" (static per-head scales) or "bfloat16"; ``phase`` "decode" (32 sequences at 4k, one new
    token each) or "prefill" (one 2048-token prompt)."""
    import torch

    from kv8.kernels.triton import attention as A
    from kv8.platform import Platform
    from kv8.quant.formats import E4M3FNUZ

    heads, kv_heads, dim, bs = 32, 8, 128, 16
    q_lens, ctxs = {"decode": ([1] * 32, [4096] * 32), "prefill": ([2048], [2048])}[phase]
    fp8 = kv == "fp8_e4m3fnuz"
    if not fp8 and kv != "bfloat16":
        raise ValueError(f"kv={kv!r}: allowed 'fp8_e4m3fnuz', 'bfloat16'")
    query = torch.zeros(sum(q_lens), heads, dim, dtype=torch.bfloat16)
    cache = torch.zeros(16, kv_heads, bs, dim, dtype=torch.uint8 if fp8 else torch.bfloat16)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    launches = A.plan_launches(
        query, cache, cache.clone(), torch.empty_like(query), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_tables=torch.zeros(len(q_lens), -(-max(ctxs) // bs), dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(ctxs), scale=dim ** -0.5, sliding_window=None,
        fp8=E4M3FNUZ if fp8 else None, k_scale=torch.ones(kv_heads, 1) if fp8 else None,
        v_scale=torch.ones(kv_heads, 1) if fp8 else None, k_token_scales=None, v_token_scales=None,
        num_kv_splits=None, min_query_len=min(q_lens),
        platform=Platform.cuda((9, 4), "MI300X", "gfx942", compute_units=MI300_COMPUTE_UNITS))
    return launches[0]


def store_launch() -> Any:
    """What :func:`~kv8.kernels.triton.store.store_kv` launches for one decode step of 32 sequences into an
    E4M3FNUZ cache with static per-head scales."""
    import torch

    from kv8.kernels.triton import store as S
    from kv8.kernels.triton.formats import kernel_format
    from kv8.quant.formats import E4M3FNUZ

    key = torch.zeros(32, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(16, 8, 16, 128, dtype=torch.uint8)
    slots = torch.arange(32, dtype=torch.int64)
    scale = torch.ones(8, 1).expand(8, 128)
    return S.store_launch(key, key.clone(), cache, cache.clone(), slots, scale, scale, slots, slots,
                          (scale.stride(0), scale.stride(1)) * 2, (0, 0, 0) * 2, mode=1, fmt=kernel_format(E4M3FNUZ))


def figures() -> dict[str, dict[str, Any]]:
    """The compiled figures of decode and prefill attention over E4M3FNUZ and bf16, and of the FP8 store."""
    rows: dict[str, dict[str, Any]] = {}
    for phase in ("decode", "prefill"):
        for kv in ("fp8_e4m3fnuz", "bfloat16"):
            launch = attention_launch(kv, phase)
            fig = measure(compile_launch(launch), int(launch.kwargs["num_warps"]), int(launch.kwargs["num_stages"]))
            rows[f"{phase}-{kv}"] = {"native_fp8": launch.kwargs["NATIVE_FP8"], "TILE_N": launch.kwargs["TILE_N"],
                                     **asdict(fig)}
    launch = store_launch()
    rows["store-fp8_e4m3fnuz"] = asdict(measure(compile_launch(launch), int(launch.kwargs["num_warps"]), 1))
    return rows


def violations(rows: dict[str, dict[str, Any]]) -> list[str]:
    """What the kernels promise on gfx942, as the list of promises ``rows`` (:func:`figures`) break: no spills to
    memory (scratch, VGPR spills); the pipeline buffers fit the 64 KB of LDS; over E4M3FNUZ the attention decodes
    in hardware (the platform picks the native path and it lowers to ``v_cvt_pk_f32_fp8``), bf16 converts no FP8."""
    bad = []
    for name, r in rows.items():
        if r["vgpr_spills"] or r["scratch_bytes"]:
            bad.append(f"{name}: {r['vgpr_spills']} VGPR spills, {r['scratch_bytes']} bytes of scratch per lane")
        if r["lds_bytes"] > MI300_LDS_BYTES:
            bad.append(f"{name}: {r['lds_bytes']} bytes of LDS > {MI300_LDS_BYTES}")
        if name.startswith("store-"):
            continue
        if "fp8" in name and (not r["native_fp8"] or not any(c.startswith("v_cvt_pk_f32_fp8") for c in r["cvt_fp8"])):
            bad.append(f"{name}: native {r['native_fp8']}, FP8 conversions {r['cvt_fp8']}; want v_cvt_pk_f32_fp8")
        if "fp8" not in name and r["cvt_fp8"]:
            bad.append(f"{name}: FP8 conversions {r['cvt_fp8']} in a bf16 kernel")
    return bad


def table(rows: dict[str, dict[str, Any]]) -> str:
    cols = ("vgprs", "sgprs", "occupancy", "vgpr_spills", "sgpr_spills", "scratch_bytes", "lds_bytes", "num_warps",
            "num_stages", "TILE_N")
    lines = ["kernel (gfx942)".ljust(22) + " ".join(c.rjust(13) for c in cols) + "  cvt_fp8"]
    for name, r in rows.items():
        lines.append(name.ljust(22) + " ".join(str(r.get(c, "-")).rjust(13) for c in cols)
                     + "  " + ",".join(r["cvt_fp8"]))
    return "\n".join(lines)


def main() -> None:
    rows = figures()
    print(table(rows))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
